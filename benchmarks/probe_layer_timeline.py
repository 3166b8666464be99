"""Where a batch-1 decode layer's time goes inside its native W4A16 matmuls (H200).

The Llama-3-8B-shaped W4 model of ``bench_decode.py`` with ``--layers`` decoder layers, compiled and
captured as ``CapturedDecode`` (batch 1), but with every M = 1 launch of the native decode kernel
built with ``QOPS_STAMPS`` (``qops/native/w4a16_gemv.cu``): thread 0 of each block writes the global
timer when the block starts, when its ``griddepcontrol.wait`` returns (the kernel ahead has completed),
when x is staged, when the main loop ends and when the block ends, plus the SM cycles of the last
three spans. The stamps go to a probe-owned buffer passed as the kernel's workspace pointer (the M = 1
plans of these shapes use none: one block per column tile, or a cluster). The launches are the model's
own, with programmatic dependent launch as in ``bench_decode.py``; the builds differ from the shipped
ones only by the stamps (a few instructions in thread 0).

Variants (``--variants``): the shipped plans (``base``) and the M = 1 plan options of
``profile_decode.py`` (``l2pf``, ``bf16mma``, ``prewait``, ``fold``, joined by ``+``), all on one model
and one compiled step; each is captured twice, with and without stamps, and the unstamped graphs are
timed with interleaved trials (the step time the variant would give). ``late`` (joined like an option)
keeps the gated gate/up launches from releasing the next launch as they start
(``qops.native.int_weight.early_dependents_flag``): they release it after their main loop.

Per matmul launch of the last replay (a "site": qkv, o, gate_up, down of each layer), in microseconds
from the step's first stamp: the first block's start, the earliest and latest return from the wait
(the earliest ~ the kernel ahead completing), the median block's x staging, main loop and epilogue
(reduction and stores), the last block's end; ``post_wait`` = end - earliest wait return (what the
step waits for after the kernel ahead), ``gap_before`` = this site's earliest wait return - the
previous site's end (the attention or a norm between them, and the releases).

    PYTHONPATH=. python benchmarks/probe_layer_timeline.py [--layers 4] [--replays 20] [--out F]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
import types

import torch

import bench_decode
import common
import profile_decode

SLOTS = 8  # 64-bit stamp slots a block (w4a16_gemv.cu, QOPS_STAMPS)
CYCLE_MASK = (1 << 48) - 1  # the cycle counts' bits of slots 5..7 (slot 5: the SM id above them)


def block_stamps(stamps, site) -> torch.Tensor:
    """One stamped launch's slots on the CPU, ``(blocks, SLOTS)``, block order."""
    return stamps[site["offset"]: site["offset"] + site["blocks"] * SLOTS].view(site["blocks"], SLOTS).cpu()


def block_sms(v: torch.Tensor) -> torch.Tensor:
    """The SM each block ran on (slot 5's bits 48..63) from :func:`block_stamps`."""
    return v[:, 5] >> 48


def block_loops_us(v: torch.Tensor) -> torch.Tensor:
    """Each block's main-loop span (x staged -> loop done) in us from :func:`block_stamps`."""
    return (v[:, 3] - v[:, 2]).double() / 1e3


STAMP_REG_LIMIT = 128  # registers a thread that leave two 256-thread blocks an SM (64K registers)


def _registers(kernel) -> int:
    """Registers a thread of a loaded kernel (cuda.core: an attribute, or a method in older releases)."""
    v = kernel.attributes.num_regs
    return int(v() if callable(v) else v)


class Stamper:
    """Wraps ``compiler.get_kernel`` and ``compiler.launch`` while ``on``: decode-kernel builds of the
    tile heights ``mts`` (M = 1 by default) get ``QOPS_STAMPS``, and each launch of one writes its stamps
    to a fresh region of ``buf`` (after room for its fp32 partials where it sums through the workspace;
    the split-K finish launched next then reads them there, so the output stays right)."""

    def __init__(self, compiler, niw, buf, mts=(1,)):
        self.compiler, self.niw, self.buf, self.mts = compiler, niw, buf, set(mts)
        self.reduce_ws = None  # the workspace the next split-K finish reads (set by a stamped launch)
        self.on = False
        self.defines_of = {}  # id(kernel) -> defines of every decode-kernel build handed out (QOPS_STAMPS: stamped)
        self.sites = []  # per launch while on: dict(defines, grid, offset)
        self.used = 0  # slots handed out (never reused: every captured launch keeps its own region)
        self._get, self._launch = compiler.get_kernel, compiler.launch

    def get_kernel(self, device, source_name, defines, kernel_name, **kw):
        if not (self.on and source_name == self.niw.SOURCE and kernel_name == self.niw.GEMV and int(defines["QOPS_MT"]) in self.mts):
            k = self._get(device, source_name, defines, kernel_name, **kw)
            if source_name == self.niw.SOURCE and kernel_name in (self.niw.GEMV, self.niw.REDUCE):
                self.defines_of[id(k)] = dict(defines, kernel=kernel_name)
            return k
        d = {**defines, "QOPS_STAMPS": 1}
        k = self._get(device, source_name, d, kernel_name, **kw)
        # The stamps cost a few registers: a build at 126-128 (two blocks an SM of 256 threads) can cross
        # 128 and lose its second block an SM (28672x4096 at M = 1, fp16: 128 -> 133), so the stamped grid
        # would run in two waves where the shipped one runs in one. Hold such a build to two blocks an SM.
        plain = self._get(device, source_name, defines, kernel_name, **kw)
        if _registers(plain) <= STAMP_REG_LIMIT < _registers(k):
            d = {**d, "QOPS_MINB": max(int(d["QOPS_MINB"]), 2)}
            k = self._get(device, source_name, d, kernel_name, **kw)
        self.defines_of[id(k)] = d
        return k

    @contextlib.contextmanager
    def late_gated_release(self, on: bool):
        """While ``on``: no early release for gated (QOPS_GLU) decode-kernel launches."""
        early = self.niw.early_dependents_flag
        if on:
            def flag(kernel, *a):
                return 0 if int(self.defines_of.get(id(kernel), {}).get("QOPS_GLU", 0)) else early(kernel, *a)
            self.niw.early_dependents_flag = flag
        try:
            yield
        finally:
            self.niw.early_dependents_flag = early

    def launch(self, kernel, grid, block, shmem, stream, *args, **kw):
        d = self.defines_of.get(id(kernel))
        if d is not None and d.get("kernel") == self.niw.REDUCE and self.reduce_ws is not None:
            args = list(args)
            args[0], self.reduce_ws = self.reduce_ws, None  # ws: where the stamped launch put its partials
            return self._launch(kernel, grid, block, shmem, stream, *args, **kw)
        if d is None or not d.get("QOPS_STAMPS"):
            return self._launch(kernel, grid, block, shmem, stream, *args, **kw)
        blocks = grid[0] * grid[1]
        start = self.used
        if grid[1] > 1 and int(d["QOPS_CLUSTER"]) == 1:  # the kernel's stamps follow its S x M x N fp32 partials
            self.used += -(-grid[1] * int(args[7]) * int(args[8]) // 2)
        offset = self.used
        self.used += blocks * SLOTS
        if self.used * 8 > self.buf.numel() * self.buf.element_size():
            raise RuntimeError("stamp buffer full")
        # Why a grid runs in one wave or two: the driver's blocks per SM for this launch, and whether
        # it released the next launch at its start (the flags argument, index 14 of the decode kernel's).
        per_sm = self.compiler.max_active_blocks(kernel, stream.device_index, block[0] * block[1] * block[2], shmem)
        early = bool(int(args[14]) & self.niw._EARLY_DEPENDENTS)
        self.sites.append({"defines": d, "grid": list(grid), "blocks": blocks, "offset": offset, "per_sm": per_sm, "early": early,
                           "shmem": shmem})
        args = list(args)
        args[6] = self.buf.data_ptr() + start * 8  # ws
        if offset != start:
            self.reduce_ws = args[6]
        return self._launch(kernel, grid, block, shmem, stream, *args, **kw)


def site_rows(stamps, sites) -> list[dict]:
    """Per site (launch order): its spans in us, relative to the first stamp of the step."""
    per = [block_stamps(stamps, s) for s in sites]
    t_origin = min(int(v[:, 0].min()) for v in per)
    rows, prev_end = [], None
    for s, v in zip(sites, per):
        t = v[:, :5].double()
        cyc = (v[:, 5:8] & CYCLE_MASK).double()  # slot 5 carries the SM id in bits 48..63
        d = s["defines"]
        us = lambda a: round(float(a) / 1e3, 2)  # noqa: E731
        wait_min, end = t[:, 1].min(), t[:, 4].max()
        row = {
            "site": s.get("name"), "grid": s["grid"], "nwn": int(d["QOPS_NWN"]), "cluster": int(d["QOPS_CLUSTER"]), "glu": int(d["QOPS_GLU"]),
            "per_sm": s.get("per_sm"), "early": s.get("early"), "shmem": s.get("shmem"),
            "start": us(t[:, 0].min() - t_origin), "start_max": us(t[:, 0].max() - t_origin), "wait_min": us(wait_min - t_origin), "wait_max": us(t[:, 1].max() - t_origin),
            "pre_wait_med": us(torch.median(t[:, 1] - t[:, 0])),
            "x_med": us(torch.median(t[:, 2] - t[:, 1])), "loop_med": us(torch.median(t[:, 3] - t[:, 2])), "loop_max": us((t[:, 3] - t[:, 2]).max()),
            "epi_med": us(torch.median(t[:, 4] - t[:, 3])), "end": us(end - t_origin), "post_wait": us(end - wait_min),
            "cycles_med": [int(torch.median(cyc[:, i])) for i in range(3)],
            "gap_before": None if prev_end is None else us(wait_min - prev_end),
        }
        rows.append(row)
        prev_end = end
    return rows


def capture_variant(model, step, st, stamped: bool, override, prompt_len: int, tok, pos, layers: int, late: bool = False):
    """A ``CapturedDecode`` of ``step`` under the plan ``override`` (None: the shipped plans), with the
    M = 1 launches stamped or not (``late``: :meth:`Stamper.late_gated_release`); returns it with its
    stamped sites (the last step's, launch order)."""
    from qops.models import CapturedDecode
    from qops.native import int_weight as niw

    with niw.plan_override(override) if override is not None else contextlib.nullcontext(), st.late_gated_release(late):
        st.on = stamped
        try:
            step(tok, pos)  # compiles and loads the builds this variant launches, outside any capture
            torch.cuda.synchronize()
            st.sites.clear()
            cap = CapturedDecode(model, step, 1, start_position=prompt_len)
        finally:
            st.on = False
    sites = st.sites[-4 * layers:] if stamped else []  # CapturedDecode may run the step before capturing
    for i, s in enumerate(sites):
        layer, role = divmod(i, 4)
        s["name"] = f"L{layer}.{('qkv', 'o', 'gate_up', 'down')[role]}"
    return cap, [dict(s) for s in sites]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--trials", type=int, default=5, help="interleaved timing trials of the unstamped graphs")
    p.add_argument("--variants", default="base", help="comma-separated: base, or profile_decode plan options joined by + (l2pf+bf16mma)")
    p.add_argument("--stamp-slots", type=int, default=1 << 22, help="64-bit stamp slots on the GPU")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-seq", type=int, default=88)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16", help="the model's dtype (float16: bench_decode's w4-fp16)")
    p.add_argument("--out")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    common.add_repo_to_path()
    from qops.models import LlamaConfig, compile_decode
    from qops.native import compiler
    from qops.native import int_weight as niw

    config = dataclasses.replace(LlamaConfig.llama3_8b(), num_hidden_layers=a.layers)
    bargs = types.SimpleNamespace(batch_list=[1], max_seq=a.max_seq, seed=a.seed)
    model = bench_decode.build("w4", config, torch.device("cuda"), getattr(torch, a.dtype), bargs)
    buf = torch.zeros(a.stamp_slots, dtype=torch.int64, device="cuda")
    st = Stamper(compiler, niw, buf)
    compiler.get_kernel, compiler.launch = st.get_kernel, st.launch
    res = {"probe": "layer_timeline", "device": common.device_name(True), "commit": common.git_commit(), "dtype": a.dtype, "layers": a.layers,
           "replays": a.replays, "max_seq": a.max_seq, "variants": {}}
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    try:
        gen = torch.Generator().manual_seed(a.seed)
        prompts = torch.randint(0, config.vocab_size, (1, a.prompt_len), generator=gen).cuda()
        with torch.no_grad():
            tok = model.prefill(prompts).argmax(-1)
            step = compile_decode(model, cuda_graphs=False, greedy=True)
            pos = torch.full((1,), a.prompt_len, dtype=torch.long, device="cuda")
            caps = {}
            for v in variants:
                opts = [] if v == "base" else v.split("+")
                late = "late" in opts
                opts = [o for o in opts if o != "late"]
                override = profile_decode.plan_override_for(opts) if opts else None
                plain, _ = capture_variant(model, step, st, False, override, a.prompt_len, tok, pos, a.layers, late)
                stamped, sites = capture_variant(model, step, st, True, override, a.prompt_len, tok, pos, a.layers, late)
                caps[v] = (plain, stamped, sites)
            times = {v: [] for v in variants}
            for _ in range(a.trials):  # interleaved: a drift moves every variant alike
                for v in variants:
                    times[v] += bench_decode.time_captured(caps[v][0], tok, pos, a.replays, 1)
            for v in variants:
                plain, stamped, sites = caps[v]
                stamped_ms = statistics.median(bench_decode.time_captured(stamped, tok, pos, a.replays, 3))
                stamped.start(tok, pos)
                for _ in range(a.replays):
                    stamped.replay()
                torch.cuda.synchronize()
                res["variants"][v] = {"step_ms": statistics.median(times[v]), "trials_ms": times[v], "stamped_step_ms": stamped_ms,
                                      "sites": site_rows(buf, sites)}
    finally:
        compiler.get_kernel, compiler.launch = st._get, st._launch
    common.write_json(res, common.output_paths("probe_layer_timeline.json", a.out))
    for v, r in res["variants"].items():
        print(f"== {v}: step {r['step_ms'] * 1e3:.1f} us ({a.layers} layers + head; {r['stamped_step_ms'] * 1e3:.1f} with stamps)")
        print("site | grid | per SM | early | start first..last | wait min..max | pre-wait | x | loop med/max | epi | end | post-wait | gap before")
        shown = r["sites"] if a.layers <= 4 else r["sites"][8:16]  # two middle layers of a long model
        for s in shown:
            print(f"{s['site']} | {s['grid']} | {s['per_sm']} | {int(bool(s['early']))} | {s['start']}..{s['start_max']} | {s['wait_min']}..{s['wait_max']} | {s['pre_wait_med']} | {s['x_med']} | "
                  f"{s['loop_med']}/{s['loop_max']} | {s['epi_med']} | {s['end']} | {s['post_wait']} | {s['gap_before']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
