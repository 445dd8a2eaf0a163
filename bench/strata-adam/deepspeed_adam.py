# strata-adam --vs-deepspeed: times DeepSpeed's own CPU-side optimizer work on
# the numel strata-adam measures: DeepSpeedCPUAdam.step() (its cpu_adam op,
# built by its op builder) over fp32 gradients, then the separate bf16 copy of
# the parameters (torch copy_) — what ZeRO-3 with offload_optimizer does per
# sub-group once the gradient has landed in its fp32 buffer (the landing is a
# device-to-host transfer; strata-adam times its stand-in itself, the same for
# DeepSpeed's way and DeepSpeed). strata-adam embeds this file
# and runs it as a coprocess ("python -c"), one JSON object per line each way,
# so DeepSpeed and strata passes alternate with one interpreter start.
#
# Requests (stdin): {"setup": {"numel", "threads", "lr", "weight_decay", "adamw"}}
#                   then {"pass": true} any number of times.
# Replies (stdout, prefixed with the marker so DeepSpeed's own prints are
# ignored): first {"ready": true, "deepspeed", "torch", "python"} or
# {"error", "python"}; {"ok": true} to setup; {"step", "copy", "check"}
# (seconds; check: whether the copy is the bf16 rounding of the master) per pass.
import json
import sys
import time

MARK = "@@strata-adam@@ "


def reply(obj):
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


try:
    import torch
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.ops.op_builder import CPUAdamBuilder

    if not CPUAdamBuilder().is_compatible(verbose=False):
        raise RuntimeError("DeepSpeed's cpu_adam op cannot be built here")
except BaseException as e:  # ImportError, build failures, anything: report, do not crash
    reply({"error": "%s: %s" % (type(e).__name__, e), "python": sys.executable})
    sys.exit(3)

reply({"ready": True, "deepspeed": deepspeed.__version__, "torch": torch.__version__,
       "python": sys.executable})

state = {}


def setup(req):
    state.clear()
    n, threads = req["numel"], req["threads"]
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(11)
    param = torch.nn.Parameter(torch.rand(n, generator=gen, dtype=torch.float32) * 2 - 1)
    # DeepSpeed's fp32 gradient buffer, holding bf16-representable values (landed once).
    param.grad = (torch.rand(n, generator=gen, dtype=torch.float32) * 2 - 1).to(torch.bfloat16).float()
    copy = torch.empty(n, dtype=torch.bfloat16)                 # the 16-bit parameter copy
    # The op is loaded (built the first time: minutes) by the constructor.
    opt = DeepSpeedCPUAdam([param], lr=req["lr"], weight_decay=req["weight_decay"],
                           adamw_mode=req["adamw"], fp32_optimizer_states=True)
    opt.step()  # allocates and first-touches exp_avg / exp_avg_sq
    copy.copy_(param.data)
    state.update(param=param, copy=copy, opt=opt)


def one_pass():
    param, copy, opt = state["param"], state["copy"], state["opt"]
    t1 = time.perf_counter()
    opt.step()
    t2 = time.perf_counter()
    copy.copy_(param.data)
    t3 = time.perf_counter()
    # A sampled check outside the timing: the copy is the bf16 rounding of the master.
    step = max(1, param.numel() // 4096)
    ok = bool(torch.equal(copy[::step], param.data[::step].to(torch.bfloat16)))
    return {"step": t2 - t1, "copy": t3 - t2, "check": ok}


for line in sys.stdin:
    if not line.strip():
        continue
    try:
        req = json.loads(line)
        if "setup" in req:
            setup(req["setup"])
            reply({"ok": True})
        else:
            reply(one_pass())
    except BaseException as e:
        reply({"error": "%s: %s" % (type(e).__name__, e)})
