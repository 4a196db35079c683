"""Build FlashInfer's SM90 fused-MoE module with only the bf16 x MXFP4 kernels, on a CPU machine,
for `run_flashinfer_sm90_gpu.sh` (the GPU machines have no network and a session's device time
is shorter than FlashInfer's full JIT build: mxfp4-lab-log §12).

FlashInfer 0.7.2's ``fused_moe_90`` module compiles 248 translation units, 220 of them generated
CUTLASS instantiations for every dtype pair; the W4A16 MXFP4 path (`use_w4_group_scaling` with
bf16 activations) uses the 23 generated files that instantiate
``sm90_generic_mixed_moe_gemm_kernelLauncher<__nv_bfloat16, SafeFP4, ...>`` and the dispatcher
``moe_gemm_kernels_bf16_fp4.cu``. This script writes FlashInfer's own ninja file for the module
(its flags and include paths), keeps those sources and the fixed ones (binding, runner
instantiation, utilities), drops the other dtype pairs' sources, and links with lazy binding:
the dropped dtype pairs' launchers stay undefined and are never called on this path (a call
would end the process with "undefined symbol"). The driver library is linked through a stub
generated from the objects' undefined ``cu*`` symbols (no driver on a CPU machine; the GPU
machine's ``libcuda.so.1`` resolves them at load time). Then it packs FlashInfer's Python package
without its sources (``data/``) and large JSON artifacts, and copies both into ``.carry/``.

Needs: ``pip install flashinfer-python==0.7.2 apache-tvm-ffi nvidia-ml-py tabulate einops
click`` (a virtualenv with access to torch), nvcc 13.0 as ``$CUDA_HOME/bin/nvcc``, ninja, and the
headers of the ``nvidia-cublas``, ``nvidia-cuda-nvrtc``, ``nvidia-curand`` 13.0 wheels (unzipped;
``--headers`` roots holding ``nvidia/cu13/include``). About 50 minutes on 2 cores, 8 GB a job
(checked end to end on 2026-11-27: `results/flashinfer-sm90/script-build/`).

    CUDA_HOME=/usr/local/cuda-13.0 FLASHINFER_WORKSPACE_BASE=/tmp/fiws \\
      venv/bin/python benchmarks/build_flashinfer_sm90_moe.py --headers /tmp/cublas /tmp/nvrtc \\
      /tmp/curand --jobs 2
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tarfile
from pathlib import Path

KEEP_LAUNCHER = "sm90_generic_mixed_moe_gemm_kernelLauncher<__nv_bfloat16, SafeFP4"
DROP_DISPATCHERS = [
    f"moe_gemm_kernels_{pair}.cu"
    for pair in [
        "fp8_uint4",
        "fp8_fp8",
        "fp8_fp4",
        "fp4_fp4",
        "fp32_fp32",
        "fp16_uint8",
        "fp16_uint4",
        "fp16_fp16",
        "bf16_uint8",
        "bf16_uint4",
        "bf16_fp8",
        "bf16_bf16",
        "fp16_fp4",
    ]
]


def trimmed_ninja(text: str, headers: list[Path], stub_dir: Path, nvrtc_lib: Path) -> str:
    """FlashInfer's build.ninja for the module, with the bf16 x MXFP4 sources only."""
    lines, dropped = [], []
    for line in text.split("\n"):
        m = re.match(r"build (\S+): (cuda_compile|compile) (\S+)", line)
        if m:
            obj, _, src = m.groups()
            generated_other = (
                src.endswith(".generated.cu") and KEEP_LAUNCHER not in Path(src).read_text()
            )
            if generated_other or any(src.endswith("/" + d) for d in DROP_DISPATCHERS):
                dropped.append(obj)
                continue
        lines.append(line)
    out = "\n".join(lines)
    for obj in dropped:
        out = out.replace(" " + obj, "")
    includes = "".join(f"    -isystem {h}/nvidia/cu13/include $\n" for h in headers)
    out = out.replace(
        "    -isystem $cuda_home/include $\n", "    -isystem $cuda_home/include $\n" + includes
    )
    out = out.replace(
        "    -L$cuda_home/lib64/stubs $\n", f"    -L{stub_dir} $\n    -L{nvrtc_lib} $\n"
    )
    return out.replace("-lnvrtc", "-lnvrtc $\n    -Wl,-z,lazy")


def driver_stub(build_dir: Path, stub_dir: Path) -> None:
    """libcuda.so (soname libcuda.so.1) defining the objects' undefined driver functions."""
    objects = sorted(str(p) for p in build_dir.glob("*.o"))
    nm = subprocess.run(["nm", "-u", *objects], capture_output=True, text=True, check=True)
    names = sorted(set(re.findall(r"\bU (cu[A-Z]\w*)", nm.stdout)))
    stub_dir.mkdir(parents=True, exist_ok=True)
    src = stub_dir / "cuda_stub.c"
    src.write_text("".join(f"void {n}(void) {{}}\n" for n in names))
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", stub_dir / "libcuda.so", src],
        check=True,
    )
    print(f"driver stub: {len(names)} functions")


def pack_python_package(package: Path, dest: Path) -> None:
    """FlashInfer's Python files (no data/ sources, no large JSON artifacts) as a .tar.xz."""

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        rel = (
            Path(info.name).relative_to("flashinfer").as_posix()
            if info.name != "flashinfer"
            else ""
        )
        if rel.startswith(("data", "moe_ep")) or "__pycache__" in rel or "/artifacts" in rel:
            return None
        return info

    with tarfile.open(dest, "w:xz") as tar:
        tar.add(package, arcname="flashinfer", filter=keep)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--headers", nargs="+", type=Path, required=True)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--carry", type=Path, default=Path(__file__).resolve().parents[1] / ".carry")
    args = ap.parse_args()

    # no GPU here: FlashInfer's JIT takes its target from this list instead of the devices
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    import flashinfer
    from flashinfer.jit.fused_moe import gen_cutlass_fused_moe_sm90_module

    spec = gen_cutlass_fused_moe_sm90_module()
    spec.write_ninja()
    build_dir, ninja_file = spec.build_dir, spec.ninja_path
    stub_dir = build_dir / "driver-stub"
    nvrtc = next(h for h in args.headers if (h / "nvidia/cu13/include/nvrtc.h").exists())
    nvrtc_lib = nvrtc / "nvidia/cu13/lib"
    if not (nvrtc_lib / "libnvrtc.so").exists():
        os.symlink("libnvrtc.so.13", nvrtc_lib / "libnvrtc.so")
    ninja_file.write_text(trimmed_ninja(ninja_file.read_text(), args.headers, stub_dir, nvrtc_lib))
    library = str(spec.jit_library_path)
    # ninja runs in the build folder, where its own log and dependency files belong
    commands = subprocess.run(
        ["ninja", "-f", str(ninja_file), "-t", "query", library],
        capture_output=True,
        text=True,
        cwd=build_dir,
    ).stdout
    objects = [ln.strip() for ln in commands.split("input:")[1].split("outputs:")[0].split("\n")]
    objects = [o for o in objects if o.endswith(".o")]
    print(f"{len(objects)} translation units")
    subprocess.run(
        ["ninja", "-k", "0", "-j", str(args.jobs), "-f", str(ninja_file), *objects],
        check=True,
        cwd=build_dir,
    )
    driver_stub(build_dir, stub_dir)
    subprocess.run(["ninja", "-f", str(ninja_file), library], check=True, cwd=build_dir)

    args.carry.mkdir(parents=True, exist_ok=True)
    (args.carry / "fused_moe_90.so").write_bytes(Path(library).read_bytes())
    pack_python_package(Path(flashinfer.__file__).parent, args.carry / "fi-trim.tar.xz")
    print(f"wrote {args.carry}/fused_moe_90.so and fi-trim.tar.xz")


if __name__ == "__main__":
    main()
