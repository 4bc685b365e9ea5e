"""``invariant_linear.linear``: a row's result does not depend on how many rows share the call.

The probe runs the kernels of this CPU: where MKL's kernel choice stops matching the padding
rules (``MIN_ROWS``, ``COLUMNS_PER_THREAD``), it fails here before any batch test does.
"""

import pytest
import torch
import torch.nn.functional as F

from omnistage.batch_invariance import SWITCH_ENV
from omnistage.models import invariant_linear
from omnistage.models.invariant_linear import install, linear

ROW_COUNTS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 64, 257]


@pytest.fixture
def threads(request):
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(previous)


# (in, out) features: narrower than COLUMNS_PER_THREAD per thread, about as wide, and wide.
@pytest.mark.parametrize("threads", [1, 2, 3], indirect=True)
@pytest.mark.parametrize(
    "features", [(64, 8), (64, 16), (256, 24), (64, 64), (256, 1152), (1152, 256)]
)
def test_each_row_equals_itself_alone_for_every_number_of_rows(threads, features):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(features[1], features[0], generator=generator)
    bias = torch.randn(features[1], generator=generator)
    x = torch.randn(max(ROW_COUNTS), features[0], generator=generator)
    alone = torch.cat([linear(row[None], weight, bias) for row in x])
    for rows in ROW_COUNTS:
        assert torch.equal(linear(x[:rows], weight, bias), alone[:rows]), (threads, rows)


def test_leading_dims_are_kept_and_the_result_is_contiguous():
    x = torch.randn(2, 1, 16)
    out = linear(x, torch.randn(3, 16), torch.randn(3))
    assert out.shape == (2, 1, 3) and out.is_contiguous()


def test_other_dtypes_go_straight_to_aten():
    x, weight = torch.randn(1, 16, dtype=torch.float64), torch.randn(3, 16, dtype=torch.float64)
    assert torch.equal(linear(x, weight), torch._C._nn.linear(x, weight))


def test_install_puts_it_in_place_of_f_linear_where_atens_rows_vary(monkeypatch):
    monkeypatch.setattr(F, "linear", torch._C._nn.linear)
    monkeypatch.delenv(SWITCH_ENV, raising=False)
    monkeypatch.setattr(invariant_linear, "aten_rows_vary", lambda threads: True)
    assert install() and F.linear is invariant_linear.linear
    assert isinstance(torch.nn.Linear(4, 2)(torch.randn(1, 4)), torch.Tensor)


def test_install_keeps_atens_linear_where_its_rows_do_not_vary(monkeypatch):
    monkeypatch.setattr(F, "linear", torch._C._nn.linear)
    monkeypatch.delenv(SWITCH_ENV, raising=False)
    monkeypatch.setattr(invariant_linear, "aten_rows_vary", lambda threads: False)
    assert not install() and F.linear is torch._C._nn.linear


def test_the_probe_agrees_with_atens_rows_here():
    """``aten_rows_vary`` on this CPU: True exactly when some row of a GEMM differs from
    itself alone (the property ``linear`` restores), for the shapes the probe tries."""
    generator = torch.Generator().manual_seed(0)
    weight, x = torch.randn(8, 256, generator=generator), torch.randn(5, 256, generator=generator)
    differs = not torch.equal(
        torch._C._nn.linear(x, weight)[:1], torch._C._nn.linear(x[:1], weight)
    )
    assert not differs or invariant_linear.aten_rows_vary(torch.get_num_threads())


def test_install_leaves_f_linear_alone_when_batch_invariance_is_off(monkeypatch):
    monkeypatch.setattr(F, "linear", torch._C._nn.linear)
    monkeypatch.setenv(SWITCH_ENV, "0")
    assert not install() and F.linear is torch._C._nn.linear


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_torchscript_still_compiles_modules_calling_it():
    install()
    scripted = torch.jit.script(torch.nn.Linear(4, 2))
    assert scripted(torch.randn(1, 4)).shape == (1, 2)
