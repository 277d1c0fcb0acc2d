"""Build check for every CUDA kernel instance, with nvcc, for sm_80 and sm_90 (no GPU needed).

At run time the kernels are compiled by NVRTC, one template instance at a time; here every
instance the backend can launch is instantiated in one translation unit per source file (the
text the loader hands NVRTC, headers inlined) and built for both architectures, so a change that breaks any of them fails in CI. The ptxas
resource report (registers, spills, stack) is printed as a table. Skipped when nvcc is absent.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kbit_linear.backends import cuda as kcuda
from kbit_linear.backends.cuda import decode as kdecode
from kbit_linear.backends.cuda import experts as kexperts
from kbit_linear.backends.cuda import experts_token as kexperts_token
from kbit_linear.backends.cuda import hopper as khopper
from kbit_linear.backends.cuda import gguf as kgguf
from kbit_linear.backends.cuda import grouped as kgrouped
from kbit_linear.backends.cuda import hadamard as khadamard
from kbit_linear.backends.cuda import kv_append as kappend
from kbit_linear.backends.cuda import kv_attention as kkv
from kbit_linear.backends.cuda import router as krouter
from kbit_linear.backends.cuda import routing as krouting
from kbit_linear.backends.cuda import tuning
from kbit_linear import format as fmt
from kbit_linear.backends.cuda.loader import read_source

NVCC = shutil.which("nvcc")
ARCHS = ("80", "90")
_ENTRY = re.compile(r"Compiling entry function '(\w+)' for 'sm_(\w+)'")
_REGS = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def _demangle(sym: str) -> str:
    """``_Z9kbit_gemmILi4ELi1ELi0ELb1EE...`` -> ``kbit_gemm<4, 1, 0, true>`` (int and bool template
    arguments only)."""
    m = re.match(r"_Z(\d+)", sym)
    if not m:
        return sym
    n = int(m.group(1))
    name = sym[m.end(): m.end() + n]
    args = re.findall(r"L([ib])(-?\d+)E", sym[m.end() + n:].split("EE", 1)[0] + "E")
    shown = [v if kind == "i" else ("true" if v == "1" else "false") for kind, v in args]
    return f"{name}<{', '.join(shown)}>" if shown else name


def _translation_unit(source: str, instances: list[str]) -> str:
    # Taking each instance's address instantiates it; NVRTC does the same through name expressions.
    refs = ",\n".join(f"    (const void*)&{name}" for name in instances)
    return f'#include "{source}"\nconst void* kbit_instances[] = {{\n{refs}\n}};\n'


# Sources built for other targets than ARCHS: the Hopper kernel exists only for sm_90a.
SOURCE_ARCHS = {"gemm_sm90.cu": ("90a",)}


def _build(source: str, instances: list[str], workdir: Path) -> subprocess.CompletedProcess:
    # The source exactly as NVRTC gets it (headers inlined by the loader) and no include path,
    # so an include the loader does not resolve fails here too.
    expanded = workdir / f"expanded_{Path(source).stem}.cu"
    expanded.write_text(read_source(source))
    tu = workdir / f"inst_{Path(source).stem}.cu"
    tu.write_text(_translation_unit(expanded.name, instances))
    # -ftz=true: CuPy appends it to every NVRTC build (cupy/cuda/compiler.py), so that is the code that runs
    cmd = [NVCC, "-std=c++17", "-ftz=true", "-c", str(tu), "-o", str(tu.with_suffix(".o")), "-Xptxas", "-v", "--threads", "2"]
    for a in SOURCE_ARCHS.get(source, ARCHS):
        cmd += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=1200)


def _resource_table(log: str) -> list[tuple[str, str, int, int, int]]:
    rows, current = [], None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            current = [_demangle(m.group(1)), m.group(2), 0, 0, 0]
        elif current is not None and (m := _SPILL.search(line)):
            current[3], current[4] = int(m.group(2)), int(m.group(1))
        elif current is not None and (m := _REGS.search(line)):
            current[2] = int(m.group(1))
            rows.append(tuple(current))
            current = None
    return rows


@pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH: kernel build check skipped")
def test_every_kernel_instance_builds_for_sm80_and_sm90():
    jobs = {"gemm.cu": kcuda.gemm_instances(), "quantize.cu": kcuda.format_instances(), "decode.cu": kdecode.decode_instances(),
            "gemm_sm90.cu": khopper.instances() + kgrouped.instances(), "route.cu": krouting.route_instances(),
            "gguf.cu": kgguf.gguf_instances(), "kv_attention.cu": kkv.kv_attention_instances(), "kv_append.cu": kappend.kv_append_instances(),
            "hadamard.cu": khadamard.hadamard_instances(), "experts.cu": kexperts.experts_instances(),
            "experts_token.cu": kexperts_token.token_instances(), "router.cu": krouter.router_instances()}
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1))) as pool:
        results = dict(zip(jobs, pool.map(lambda kv: _build(kv[0], kv[1], Path(tmp)), jobs.items())))
    failures = [f"{src}:\n{r.stderr[-6000:]}" for src, r in results.items() if r.returncode != 0]
    assert not failures, "kernel build failed:\n" + "\n".join(failures)
    rows = [row for r in results.values() for row in _resource_table(r.stderr + r.stdout)]
    print("\n| kernel | arch | registers | spill bytes (st) | stack bytes |")
    print("|---|---|---|---|---|")
    for name, arch, regs, spill, stack in sorted(rows):
        print(f"| {name} | sm_{arch} | {regs} | {spill} | {stack} |")
    expected = sum(len(v) * len(SOURCE_ARCHS.get(src, ARCHS)) for src, v in jobs.items())
    # The wgmma kernel must keep its MMAs asynchronous and its register hand-over: ptxas says so
    # when it serializes the MMAs or ignores setmaxnreg.
    log = [line for r in results.values() for line in (r.stderr + r.stdout).splitlines()]
    broken = [line for line in log if "serialized" in line or "setmaxnreg" in line]
    assert not broken, "\n".join(broken[:5])
    # Its warpgroups trade registers inside the launch allocation: every instance must be
    # compiled with exactly the cap it is launched with (hopper.launch_registers).
    for name, arch, regs, _, _ in rows:
        if name.startswith("kbit_gemm_sm90"):  # the dense and the grouped kernel
            tile = int(name.split(",")[1])
            assert regs == khopper.launch_registers(tile), f"{name}: {regs} registers, launched with {khopper.launch_registers(tile)}"
    # The KV decode kernel's split planner counts on resident_blocks_per_sm blocks per SM: its
    # registers must allow that many (the __launch_bounds__ minimum says the same to ptxas).
    for name, arch, regs, _, _ in rows:
        if name.startswith("kbit_kv_decode<"):
            d = int(name.split("<")[1].split(",")[0])
            blocks = kkv.resident_blocks_per_sm(d, 1 << 30)
            assert regs * 32 * kkv._WARPS * blocks <= 65536, f"{name}: {regs} registers do not fit {blocks} blocks per SM"
    assert len(rows) == expected, f"ptxas reported {len(rows)} entry points, expected {expected}"


# ---------------------------------------------------------------------------------------
# the host's copies of kernel facts: parameter lists and shared-memory sizes
# ---------------------------------------------------------------------------------------

# A kernel's name and parameter list: the first "name(params) {" after __global__ (the
# parameters hold no parentheses; __launch_bounds__(...) before the name may).
_SIGNATURE = re.compile(r"(\w+)\s*\(([^()]*)\)\s*\{")


def _kernel_params(source: str) -> dict[str, list[tuple[str, str]]]:
    """``{kernel name: [(parameter name, kind p/i/f), ...]}`` from a ``.cu`` source's ``__global__`` functions."""
    out = {}
    text = read_source(source)
    for start in [m.end() for m in re.finditer(r"__global__", text)]:
        name, params = _SIGNATURE.search(text, start).groups()
        parsed = []
        for decl in params.split(","):
            decl = " ".join(decl.split())
            pname = re.findall(r"(\w+)\s*$", decl)[0]
            kind = "p" if "*" in decl else ("m" if "TensorMap" in decl else ("f" if re.match(r"^(const\s+)?float\b", decl) else "i"))
            parsed.append((pname, kind))
        out[name] = parsed
    return out


def test_kernel_argument_packs_match_the_kernel_signatures():
    """Every ArgPack names the kernel's parameters, in its order, with the right kinds."""
    packs = [kcuda.ops._GEMM_ARGS, kcuda.ops._SM90_ARGS, kcuda.ops._QUANT_ARGS, kcuda.ops._REPACK_ARGS, kcuda.ops._DEQUANT_ARGS,
             kdecode._ARGS, kdecode._GROUPED_ARGS, krouting._ARGS, kgguf._DEQUANT_ARGS, kgguf._GEMV_ARGS,
             kgguf._Q8_ARGS, kgguf._GEMV_A8_ARGS, kkv._OFFSETS_ARGS, kkv._DECODE_ARGS, kkv._COMBINE_ARGS, kkv._MASS_ARGS,
             khadamard._ARGS, kgrouped._ARGS, kexperts._SWIGLU_ARGS, kexperts._COMBINE_ARGS,
             kexperts_token._GATE_UP_ARGS, kexperts_token._DOWN_ARGS, kappend._ARGS, kappend._IN_PLACE_ARGS]
    sources = {**_kernel_params("gemm.cu"), **_kernel_params("quantize.cu"), **_kernel_params("decode.cu"),
               **_kernel_params("gemm_sm90.cu"), **_kernel_params("route.cu"), **_kernel_params("gguf.cu"),
               **_kernel_params("kv_attention.cu"), **_kernel_params("hadamard.cu"), **_kernel_params("experts.cu"),
               **_kernel_params("experts_token.cu"), **_kernel_params("kv_append.cu")}
    assert {p.kernel for p in packs} <= set(sources), f"kernels found: {sorted(sources)}"
    for pack in packs:
        expected = sources[pack.kernel]
        assert list(zip(pack.names, pack.kinds)) == expected, f"{pack.kernel}: host {list(zip(pack.names, pack.kinds))}, kernel {expected}"


@pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH: kernel geometry check skipped")
def test_host_shared_memory_sizes_match_the_kernels(tmp_path):
    """The host's shared-memory sizes (what a launch asks for) equal the kernels' own, for every
    instance the dispatcher can launch and the other decode launch shapes the tests use: an
    underestimate would let a kernel write past its shared memory; and the dequantize kernel's
    items per warp, which its grid is sized by."""
    gemm = [(b, mb) for b in fmt.SUPPORTED_BITS for mb in kcuda.tuning.FUSED_ROW_BLOCKS]
    configs = {(b, mt, c) for (b, mt), cs in kcuda.tuning.all_decode_configs().items() for c in cs}
    configs |= {(b, mt, kcuda.tuning.DecodeConfig(*v)) for (b, mt), vs in kcuda.tuning.DECODE_VARIANTS.items() for v in vs}
    configs = sorted(configs, key=lambda t: (t[0], t[1], t[2].warps, t[2].k_warps, t[2].row_groups))
    programs = {
        "gemm.cu": [f'printf("gemm {b} {mb} %d\\n", (int)kbit::GemmShape<{b}, {mb}>::SMEM_BYTES);' for b, mb in gemm],
        "gemm_sm90.cu": [f'printf("sm90 {b} {bt} %d\\n", (int)kbit::sm90::Shape<{b}, {bt}>::SMEM_BYTES);'
                         for b in fmt.SUPPORTED_BITS for bt in khopper.TOKEN_TILES],
        "decode.cu": [f'printf("decode {b} {mt} {c.warps} {c.k_warps} {c.row_groups} %d\\n", '
                      f'kbit_decode::DecodeSmem<{b}, {mt}, {c.warps}, {c.k_warps}, {c.row_groups}>::kBytes);' for b, mt, c in configs],
        "kv_attention.cu": [f'printf("kv {d} {int(pair)} %d\\n", kbit::kv::Smem<{d}, {str(pair).lower()}>::BYTES);'
                            for d in kkv.HEAD_DIMS for pair in (False, True)]
        + ['printf("kv mass threads %d\\n", kMassThreads);', 'printf("kv combine threads %d\\n", kCombineThreads);'],
        "quantize.cu": ['printf("dequantize items %d\\n", kDequantItems);'],
        "router.cu": ['printf("router threads %d\\n", kbit::router::kThreads);'],
    }
    kernel = {}
    for source, lines in programs.items():  # one program per source: each inlines common.cuh
        stem = Path(source).stem
        (tmp_path / source).write_text(read_source(source))
        main = tmp_path / f"main_{stem}.cu"
        main.write_text(f'#include <cstdio>\n#include "{source}"\nint main() {{\n' + "\n".join(lines) + "\nreturn 0;\n}\n")
        exe = tmp_path / f"geometry_{stem}"
        arch = SOURCE_ARCHS.get(source, ("80",))[0]
        build = subprocess.run([NVCC, "-std=c++17", "-gencode", f"arch=compute_{arch},code=sm_{arch}", str(main), "-o", str(exe)],
                               capture_output=True, text=True, timeout=600)
        assert build.returncode == 0, build.stderr[-4000:]
        for line in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.splitlines():
            *key, value = line.split()
            kernel[tuple(key)] = int(value)
    for b, mb in gemm:
        assert kcuda.ops._gemm_smem(b, mb) == kernel[("gemm", str(b), str(mb))], f"gemm bits={b} MB={mb}"
    limit = 227 * 1024  # the opt-in shared memory of a block on sm_90
    for b in fmt.SUPPORTED_BITS:
        for bt in khopper.TOKEN_TILES:
            assert khopper.smem_bytes(b, bt) == kernel[("sm90", str(b), str(bt))], f"sm90 bits={b} BT={bt}"
            assert khopper.smem_bytes(b, bt) <= limit, f"sm90 bits={b} BT={bt} needs more than an sm_90 block has"
    for d in kkv.HEAD_DIMS:
        for pair in (False, True):
            assert kkv.decode_smem_bytes(d, pair) == kernel[("kv", str(d), str(int(pair)))], f"kv_attention head_dim={d} pair={pair}"
    # launch facts the host copies: the block sizes of the mass, combine and router kernels
    assert kkv._MASS_THREADS == kernel[("kv", "mass", "threads")]
    assert kkv._COMBINE_THREADS == kernel[("kv", "combine", "threads")]
    assert krouter._THREADS == kernel[("router", "threads")]
    for b, mt, c in configs:
        assert kdecode._smem(b, mt, c) == kernel[("decode", str(b), str(mt), str(c.warps), str(c.k_warps), str(c.row_groups))], (b, mt, c)
    # not a shared-memory size, but a launch fact the host copies too: the dequantize kernel's grid
    assert kcuda.ops.DEQUANT_WARP_ITEMS == kernel[("dequantize", "items")]


def test_kv_decode_split_plan_covers_every_key_block_once():
    # An H100 (132 SMs) holding 4 decode blocks of head_dim 128 per SM.
    for key_blocks, row_heads, resident in itertools.product([1, 5, 31, 64, 65, 512, 2048, 9999], [1, 3, 8, 64], [1, 2, 4]):
        kbps, splits, split_tiles, shift = kkv._splits(key_blocks, row_heads, resident, 132)
        assert 1 <= kbps <= kkv.MAX_SPLIT_KEY_BLOCKS and 0 <= shift < kbps
        # a short first split never adds a wave
        wave = resident * 132
        assert math.ceil(row_heads * splits / wave) == math.ceil(row_heads * math.ceil(key_blocks / kbps) / wave)
        # split s takes [max(s kbps - shift, 0), (s + 1) kbps - shift): no empty split, none left out
        assert (splits - 1) * kbps - shift < key_blocks <= splits * kbps - shift
        assert split_tiles or kbps >= tuning.KV_DECODE_MIN_KEY_BLOCKS
    # 1k tokens, batch 1, 8 KV heads: whole key blocks would give 32 blocks; shared tiles give 128
    assert kkv._splits(16, 8, 4, 132) == (1, 16, True, 0)
    # 2k and 4k tokens: whole key blocks would leave SMs idle (64 and 128 blocks): shared tiles in
    # about two blocks per SM (256 blocks); head_dim 256 (one resident block): shared tiles
    # would take splits of 4 key blocks too, the same 128 blocks, so whole key blocks
    assert kkv._splits(32, 8, 4, 132) == (1, 32, True, 0)
    assert kkv._splits(64, 8, 1, 132) == (4, 16, False, 0)
    # 8k tokens: 32 splits of 4 key blocks, one per warp (256 blocks); 32k, batch 8: whole waves
    assert kkv._splits(128, 8, 4, 132) == (4, 32, False, 0)
    assert kkv._splits(512, 64, 4, 132) == (64, 8, False, 0)
    # the mass in the combine's launch: while the grid, mass blocks included, fits one block per SM
    assert kkv._mass_in_combine(132, 132) and not kkv._mass_in_combine(133, 132)


def test_kv_decode_blocks_pair_heads_whose_rows_fill_half_a_block():
    assert kkv.pairs_heads(8, 4)  # Llama-3-8B: 4 query heads a KV head, one query
    assert kkv.pairs_heads(2, 3) and kkv.pairs_heads(4, 1)
    assert not kkv.pairs_heads(8, 8) and not kkv.pairs_heads(8, 5)  # more than 4 rows a head
    assert not kkv.pairs_heads(1, 4) and not kkv.pairs_heads(7, 4)  # a head without a partner
    # and only for long splits of whole key blocks (32k tokens at batch 8, 128k at batch 1), not
    # where a warp has one key block (32k at batch 1) or the warps share tiles (short contexts)
    assert kkv._pair_pays(kkv.SplitPlan(32, 16, False)) and kkv._pair_pays(kkv.SplitPlan(16, 128, False))
    assert not kkv._pair_pays(kkv.SplitPlan(4, 128, False)) and not kkv._pair_pays(kkv.SplitPlan(8, 64, True))


def test_kv_decode_grid_pairs_heads_only_over_caches_with_widths_below_8_bits(monkeypatch):
    props = SimpleNamespace(sm_count=132, shared_per_sm=233472, max_shared_per_block=232448)  # H100 / H200
    monkeypatch.setattr(kkv.loader, "device_properties", lambda device: props)
    cpu = torch.device("cpu")
    # 32k tokens (512 key blocks of 64), batch 8, Llama-3-8B's heads: 4 head pairs a row
    pair, block_rows, plan = kkv._decode_grid(512, 8, 8, 4, 128, cpu, low_widths=True)
    assert pair and block_rows == 4 and kkv._pair_pays(plan)
    # a cache of 8-bit tokens only: the pair's 8-bit tiles take one head each, so one head a block
    pair, block_rows, plan = kkv._decode_grid(512, 8, 8, 4, 128, cpu, low_widths=False)
    assert not pair and block_rows == 8 and plan.shift == 0
    # 32k at batch 1: one key block a warp under the pair's plan, so one head a block
    assert kkv._decode_grid(512, 1, 8, 4, 128, cpu, low_widths=True)[:2] == (False, 8)


def test_kv_decode_first_split_is_short_where_the_grid_has_room():
    # 4k tokens, batch 1: splits of 2 key blocks with shared tiles; the first takes key block 0
    # alone (its 5 tiles: at most 2 a warp, as in every other split), 33 splits in 264 blocks
    assert kkv._splits(64, 8, 4, 132) == (2, 33, True, 1)
    # not where the split it adds would start another wave (head_dim 256, one block per SM: 2k
    # tokens in 128 blocks of 132), nor where the cache has no width below 8 bits (no sinks' tile)
    assert kkv._splits(32, 8, 1, 132) == (2, 16, True, 0)
    assert kkv._splits(64, 8, 4, 132, sinks_tile=False) == (2, 32, True, 0)
    # 32k tokens, batch 1: whole key blocks, 2 a warp; the first split one a warp. 128k: 8 a warp,
    # where one tile more is too small a share to pay for another split
    assert kkv._splits(512, 8, 4, 132) == (8, 65, False, 4)
    assert kkv._splits(2048, 8, 4, 132) == (32, 64, False, 0)
    # no room for another split in the wave (32k, batch 8), or no share to take off (one key
    # block a split; 4 whole key blocks, one a warp): no shift
    assert kkv._splits(512, 64, 4, 132).shift == 0
    assert kkv._splits(16, 8, 4, 132).shift == 0
    assert kkv._splits(128, 8, 4, 132).shift == 0
