"""Ahead-of-time compiles for sm_90 through Triton's bundled ptxas: no GPU needed, so the CPU
suite checks what no interpreter runs (inline PTX, layouts, shared memory, instruction order)."""

from __future__ import annotations

from typing import Any


def compile_for_sm90(
    fn: Any,
    signature: dict[str, str],
    constexprs: dict[str, Any],
    aligned: tuple[str, ...] = (),
    **options: Any,
) -> Any:
    """The compiled kernel of `fn` (a Triton or Gluon JIT function) for sm_90: `signature`
    gives each runtime argument's type, `constexprs` the values of the constexpr ones (marked
    "constexpr" in the signature here), `aligned` the arguments to compile as multiples of 16
    (pointers 16-byte aligned, as the JIT specialises them), `options` Triton's (num_warps,
    launch_pdl, ...)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction

    sig = {**signature, **{name: "constexpr" for name in constexprs}}
    values = {(fn.arg_names.index(name),): v for name, v in constexprs.items()}
    source = GluonASTSource if isinstance(fn, GluonJITFunction) else ASTSource
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    src = source(fn=fn, signature=sig, constexprs=values, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _on_cubin(kernel: Any, tool: str, *args: str) -> str:
    """The output of Triton's bundled `tool` (a CUDA binary utility) run on the kernel's cubin."""
    import os
    import subprocess
    import tempfile

    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        done = subprocess.run([path, *args, cubin], capture_output=True, text=True, check=True)
    return done.stdout


def resource_usage(kernel: Any) -> str:
    """cuobjdump's resource line of a compiled kernel's cubin (``REG:.. STACK:.. SHARED:..
    LOCAL:..``), through the tool bundled with Triton."""
    return _on_cubin(kernel, "cuobjdump", "--dump-resource-usage")


def sass(kernel: Any) -> str:
    """The SASS of a compiled kernel's cubin (nvdisasm, bundled with Triton)."""
    return _on_cubin(kernel, "nvdisasm", "-c")
