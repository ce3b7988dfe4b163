"""Do the C++ argument checks of ds_adaptive::ln_modulate_apply raise cleanly on CUDA inputs?

Issue 18: at 5feed20 a GPU test segfaulted (torch 2.11, H200) when the op's C++ checks raised a
ValueError for a CUDA input; since then ds_adaptive.ops.ln_modulate checks in Python first. This
calls the op directly with each bad input in its own subprocess (a crash then costs one case, not
the run) and prints the exit code and the exception type / message or the fault. GPU only.

    python bench/ln_modulate_cpp_errors.py
"""
from __future__ import annotations

import subprocess
import sys

SETUP = """
import faulthandler, torch
faulthandler.enable()
from ds_adaptive.ops.ln_modulate import load_op
load_op(strict=True)
op = torch.ops.ds_adaptive.ln_modulate_apply.default
x = torch.randn(2, 5, 64, device="cuda", dtype=torch.bfloat16)
sh = torch.randn(2, 64, device="cuda")
sc = torch.randn(2, 64, device="cuda")
try:
    {call}
    print("RESULT no exception")
except Exception as e:
    print("RESULT", type(e).__name__, str(e).splitlines()[0][:160])
"""

CASES = {
    "shift shape (TORCH_CHECK_VALUE)": "op(x, sh[..., :32], sc, 1e-6, None, None)",
    "shift on cpu (TORCH_CHECK_VALUE)": "op(x, sh.cpu(), sc, 1e-6, None, None)",
    "x 2-D (TORCH_CHECK_VALUE)": "op(x[0], sh, sc, 1e-6, None, None)",
    "x int (TORCH_CHECK_TYPE)": "op(x.to(torch.int32), sh, sc, 1e-6, None, None)",
    "raw op, half modulation (TORCH_CHECK)": "torch.ops.ds_adaptive.ln_modulate(x, sh.half().unsqueeze(1), "
                                              "sc.half().unsqueeze(1), None, None, 1e-6)",
}


def main() -> int:
    bad = 0
    for name, call in CASES.items():
        p = subprocess.run([sys.executable, "-c", SETUP.replace("{call}", call)], capture_output=True, text=True,
                           timeout=300)
        res = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT")]
        tail = res[-1] if res else (p.stderr.strip().splitlines() or ["(no output)"])[-1][:300]
        print(f"{name:<42} rc={p.returncode:<4} {tail}")
        if p.returncode != 0:
            bad += 1
            print("  stderr tail:\n    " + "\n    ".join(p.stderr.strip().splitlines()[-12:]))
    print(f"{bad} of {len(CASES)} cases crashed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
