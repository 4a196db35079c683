import sys, torch
sys.path.insert(0, "tests/kernels")
from test_kbit_kernels import random_weight
from quantfw.kernels import kbit
from quantfw.kernels.kbit.triton.dispatch import kbit_matmul_cuda
torch.manual_seed(0)
for bits in (4, 2):
    planes, absmax, cb, ref = random_weight(256, 1056, bits, seed=3, device="cuda")
    w = kbit.repack_weight(planes, absmax, cb)
    for M in (1, 2, 7):
        x = torch.randn(M, 1056, device="cuda").half()
        want = x.double() @ ref.double().t()
        for swap in (False, True):
            for cps in (1, 64):  # split 1 / split > 1
                for bm, bn, bk, wp, st in ((16, 64, 128, 4, 1), (16, 64, 128, 4, 2), (16, 32, 64, 4, 1), (32, 64, 64, 4, 1)):
                    cfg = ("fused", bm, bn, bk, wp, st, cps, swap)
                    out = kbit_matmul_cuda(x, w, None, config=cfg).double()
                    rows = ((out - want).norm(dim=1) / want.norm(dim=1)).tolist()
                    print(bits, M, cfg, " ".join(f"{r:.1e}" for r in rows), flush=True)
        # where does row r's input land?
        if M == 7:
            for r in (0, 3):
                xr = torch.zeros_like(x); xr[r] = x[r]
                out = kbit_matmul_cuda(xr, w, None, config=("fused", 16, 64, 128, 4, 1, 1, False)).double()
                print("only row", r, "nonzero ->", (out.abs().sum(1) > 0).nonzero().flatten().tolist(),
                      "err of that row", ((out[r] - want[r]).norm() / want[r].norm()).item())
