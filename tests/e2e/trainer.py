"""A trainer process for the weight-sync tests: plain torch + transformers + omnistage.rl,
no server code. Run as ``python -m tests.e2e.trainer URL FOLDER BACKEND MODE [STEPS]``."""

from __future__ import annotations

import json
import os
import sys

import torch

from omnistage.rl import WeightSender, weights_checksum
from omnistage.rl.sender import _describe


def perturbed_state(folder: str, step: int) -> dict[str, torch.Tensor]:
    """The checkpoint's weights, nudged deterministically per step (what training would do)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return dict(model.state_dict())


class DyingSender(WeightSender):
    """Dies (no goodbye) in the middle of its second chunk's broadcast."""

    chunks_sent = 0

    def _send_broadcast(self, chunk):  # type: ignore[no-untyped-def]
        self.chunks_sent += 1
        if self.chunks_sent == 2:
            import torch.distributed as dist

            self._in_background(lambda: self._update(_describe(chunk)))
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            self._group.broadcast([chunk[0][1]], opts).wait()  # one tensor of the chunk...
            os._exit(3)  # ...then the trainer is gone
        super()._send_broadcast(chunk)


def main(url: str, folder: str, backend: str, mode: str, steps: int = 3) -> None:
    results = []
    if mode == "die":
        sender = DyingSender(url, backend=backend, chunk_bytes=64 * 1024)
        sender.init()
        sender.send(perturbed_state(folder, 99).items(), weight_version="never")
        return
    sender = WeightSender(url, backend=backend, chunk_bytes=64 * 1024)
    sender.init()
    for step in range(steps):
        state = perturbed_state(folder, step)
        ack = sender.send(state.items(), weight_version=step)
        results.append(
            {
                "step": step,
                "status": ack["status"],
                "version": ack["metadata"]["weight_version"],
                "checksum_ok": sender.remote_checksum() == weights_checksum(state.items()),
            }
        )
    if mode == "bad-shape":
        state = perturbed_state(folder, 0)
        name = next(n for n in sorted(state) if n.endswith("mlp.up_proj.weight"))
        state[name] = torch.zeros(3, 3)
        try:
            sender.send(state.items(), weight_version="bad")
            results.append({"bad": "accepted"})
        except Exception as exc:
            results.append({"bad": str(exc)})
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:5], *(int(a) for a in sys.argv[5:6]))
