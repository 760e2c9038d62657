"""eager_boundary: a direct call when nothing compiles, Dynamo's disabled twin (a graph break) while
``torch.compile`` traces, the same result both ways."""

from __future__ import annotations

import torch

from ringfa4.kernels import eager


def test_eager_calls_skip_dynamo_and_compiled_calls_break_the_graph(monkeypatch):
    seen = []
    real_disable = torch.compiler.disable

    def twin(fn):  # stands in for torch.compiler.disable, recording which path ran
        disabled = real_disable(fn)

        def run(*a, **k):
            seen.append("disabled")
            return disabled(*a, **k)
        return run

    monkeypatch.setattr(eager.torch.compiler, "disable", twin)

    @eager.eager_boundary
    def op(x):
        return x * 2 + 1

    x = torch.arange(4.0)
    assert torch.equal(op(x), x * 2 + 1) and seen == []  # eager: no Dynamo wrapper

    def layer(x):
        return op(x.sin()).cos()

    explained = torch._dynamo.explain(layer)(x)
    assert explained.graph_break_count >= 1
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="eager")
    assert torch.allclose(compiled(x), layer(x)) and "disabled" in seen
