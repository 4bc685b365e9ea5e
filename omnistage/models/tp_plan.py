"""How a model family's decoder splits over tensor-parallel ranks (``TPPlan``), as data the
family states and the decoder's layers read (``omnistage.models.tensor_parallel`` builds the
split layers). No torch here: a config names its plan before any model code loads."""

from __future__ import annotations

from dataclasses import dataclass

COLWISE, ROWWISE, REPLICATED = "colwise", "rowwise", "replicated"


@dataclass(frozen=True)
class TPPlan:
    """How a family's decoder splits over ranks, per layer role (``colwise``: output
    features; ``rowwise``: input features, outputs summed; ``replicated``: whole on every
    rank). Attention splits by heads (kv heads split or replicated), embeddings and the LM head
    by vocabulary rows."""

    mlp_gate_up: str = COLWISE
    mlp_down: str = ROWWISE
    expert_gate_up: str = COLWISE
    expert_down: str = ROWWISE  # summed over the experts, then once over the ranks
    router: str = REPLICATED


DENSE_PLAN = TPPlan()
