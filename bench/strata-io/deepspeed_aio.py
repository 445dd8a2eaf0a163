# strata-io --vs-deepspeed: times DeepSpeed's aio_handle (DeepNVMe, libaio) on
# the file strata-io measures. strata-io embeds this file and runs it as a
# coprocess ("python -c"), one JSON object per line each way, so DeepSpeed and
# strata passes can alternate with one interpreter start and one op load.
#
# Requests (stdin):  {"path", "rw": "read"|"write", "size", "bs", "qd",
#                     "threads", "overlap_events", "buffer_nbytes", "warmup"}
# Replies (stdout, prefixed with the marker so DeepSpeed's own prints are
# ignored): first {"ready": true, "deepspeed", "torch", "python"} or
# {"error", "python"}; then one {"seconds", "gbps"} or {"error"} per request.
import json
import sys
import time

MARK = "@@strata-io@@ "


def reply(obj):
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


try:
    import torch
    import deepspeed
    from deepspeed.ops.op_builder import AsyncIOBuilder

    builder = AsyncIOBuilder()
    if not builder.is_compatible(verbose=False):
        raise RuntimeError("DeepSpeed's async I/O op cannot be built here (is libaio-dev installed?)")
    aio = builder.load(verbose=False)
except BaseException as e:  # ImportError, build failures, anything: report, do not crash
    reply({"error": "%s: %s" % (type(e).__name__, e), "python": sys.executable})
    sys.exit(3)

reply({"ready": True, "deepspeed": deepspeed.__version__, "torch": torch.__version__,
       "python": sys.executable})

state = {"key": None, "handle": None, "buffer": None}


def handle_for(req):
    key = (req["bs"], req["qd"], req["threads"], req["overlap_events"], req["buffer_nbytes"])
    if state["key"] != key:
        if state["buffer"] is not None:
            state["handle"].free_cpu_locked_tensor(state["buffer"])
        state["handle"] = None
        state["buffer"] = None
        handle = aio.aio_handle(block_size=req["bs"], queue_depth=req["qd"], single_submit=False,
                                overlap_events=req["overlap_events"],
                                intra_op_parallelism=req["threads"])
        # DeepSpeed's own page-locked allocation (posix_memalign + mlock).
        state["buffer"] = handle.new_cpu_locked_tensor(req["buffer_nbytes"],
                                                       torch.empty(0, dtype=torch.uint8))
        state["handle"] = handle
        state["key"] = key
    return state["handle"], state["buffer"]


def one_pass(req, handle, buffer):
    size, path = req["size"], req["path"]
    start = time.perf_counter()
    offset = 0
    while offset < size:
        n = min(buffer.numel(), size - offset)
        view = buffer if n == buffer.numel() else buffer[:n]
        if req["rw"] == "read":
            done = handle.sync_pread(view, path, offset)
        else:
            done = handle.sync_pwrite(view, path, offset)
        if done != 1:
            raise RuntimeError("aio_handle %s at offset %d returned %d completed ops, not 1"
                               % (req["rw"], offset, done))
        offset += n
    return time.perf_counter() - start


for line in sys.stdin:
    if not line.strip():
        continue
    try:
        req = json.loads(line)
        handle, buffer = handle_for(req)
        for _ in range(req.get("warmup", 0)):
            one_pass(req, handle, buffer)
        seconds = one_pass(req, handle, buffer)
        reply({"seconds": seconds, "gbps": req["size"] / seconds / 1e9})
    except BaseException as e:
        reply({"error": "%s: %s" % (type(e).__name__, e)})
