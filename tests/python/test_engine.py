"""The Python binding (python/strata) over an installed strata, with numpy.

Run alone or under `strata run -n 2`: every rank runs the same calls (the
engine's collectives need it). Checks
  - a tiny linear regression (y = X w* + b*) trained with strata's AdamW, its
    parameters and optimizer state in NVMe swap files (ZeRO-3), whose loss
    falls by 20x and whose weights approach w*; the ranks split each batch, and
    gradients go in both ways (add_grad and a writable grad view);
  - a bf16 parameter round-trips through register/read; write/read;
  - bad input raises a strata.Error subclass carrying strata's message (the
    C function's name and what was wrong), and the engine stays usable;
  - an I/O failure leaves the engine unusable: later calls raise EngineFailed;
  - checkpoints: trained, saved, trained on, loaded into fresh engines (ZeRO-3
    on NVMe and ZeRO-2 in memory) bit for bit, the optimizer state too (three
    more steps agree exactly); a missing directory, a truncated or corrupt
    file, a manifest of another world size or other parameters, an edited one
    (its checksum) or one that does not parse raise InvalidArgument naming the file, and leave the engine
    usable with its own values; one rank: a child process killed with SIGKILL
    while it saves leaves the previous checkpoint loadable bit for bit;
  - arrays handed out by a window stay safe after release and close (copies,
    read-only then); complex and string values are refused;
  - the step breakdown adds up and counts the step's windows and bytes; a
    timeline recorded from Python (strata.trace) is JSON with the hook events.
Prints "python tests: ok" on success (CTest matches it).
"""

import json
import os
import shutil
import sys
import tempfile
import zlib

import numpy as np

import strata


def config(swap_dir, stage=3):
    """ZeRO-3 with parameters and optimizer state on NVMe; below 3 (as DeepSpeed) the optimizer on the CPU."""
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu"}}
    if stage == 3:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": swap_dir}
        # Threshold 0: even tiny parameters go back to NVMe after each use.
        zero["stage3_param_persistence_threshold"] = 0
        zero["offload_param"] = {"device": "nvme", "nvme_path": swap_dir}
    return {
        "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.0}},
        "zero_optimization": zero,
        "strata": {"accelerator": "cpu", "log_level": "warn", "collective_timeout_s": 60},
    }


def expect_error(kind, needle, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except kind as e:
        assert needle in str(e), f"expected {needle!r} in the message, got: {e}"
        assert isinstance(e, strata.Error), type(e)
        return e
    raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise {kind.__name__} ({needle!r})")


def linear_regression(swap_dir):
    rng = np.random.default_rng(7)
    dim, n, steps = 8, 64, 120
    w_true = rng.normal(size=(1, dim)).astype(np.float32)
    b_true = np.float32(0.5)
    with strata.Engine(config(swap_dir)) as eng:
        w = eng.register("linear.weight", np.zeros((1, dim), np.float32))
        b = eng.register("linear.bias", np.zeros((1,), np.float32))
        lin = eng.op("linear", [w, b])
        eng.finalize()
        assert eng.stats()["finalized"] == 1 and eng.stats()["param_numel"] == dim + 1
        losses = []
        for step in range(steps):
            x = np.random.default_rng(1000 + step).normal(size=(n, dim)).astype(np.float32)
            y = x @ w_true.T + b_true
            mine = slice(eng.rank, n, eng.world_size)  # this rank's half of the batch
            xs, ys = x[mine], y[mine]
            count = eng.global_sum(len(xs))
            assert count == n, count
            with eng.fetch(lin, "forward") as win:
                pred = xs @ win.param(w).T + win.param(b)
                assert not win.param(w).flags.writeable
            err = pred - ys
            loss = eng.global_sum(float((err ** 2).sum())) / count
            with eng.fetch(lin, strata.BACKWARD) as win:
                win.add_grad(w, 2 * err.T @ xs / count)   # a host gradient, copied in
                win.grad(b)[...] += 2 * err.sum(axis=0) / count  # or added in place
            result = eng.step(lr=0.05)
            assert result.applied and result.step == step + 1
            losses.append(loss)
        first, last = losses[0], float(np.mean(losses[-5:]))
        assert last < first / 20, f"the loss did not fall: {first} -> {last}"
        w_read = eng.read("linear.weight")
        assert np.abs(w_read - w_true).max() < 0.2, (w_read, w_true)
        stats = eng.stats()
        assert stats["steps"] == steps and stats["gathers"] > 0 and stats["zero_stage"] == 3
        assert stats["param_tier"] == 2 and stats["optimizer_tier"] == 2  # nvme
        if eng.rank == 0:
            print(f"linear regression: {eng.world_size} rank(s), loss {first:.4f} -> {last:.6f}, "
                  f"|w - w*| max {np.abs(w_read - w_true).max():.4f}")


def dtypes_and_values(swap_dir):
    with strata.Engine(config(swap_dir, stage=2)) as eng:
        values = np.array([[1.0, -2.5, 3.140625, 1e-3], [65504.0, 0.0, -0.0, 7.0]], np.float32)
        p16 = eng.register("half", values.astype(np.float16))
        pbf = eng.register("brain", values, dtype="bf16")
        calls = []

        def init(first, count):
            calls.append((first, count))
            return np.arange(first, first + count, dtype=np.float32)

        pcb = eng.register("counted", shape=(5, 3), init=init)
        eng.op("all", [p16, pbf, pcb])
        eng.finalize()
        assert eng.read(p16).dtype == np.float16 and np.array_equal(eng.read(p16), values.astype(np.float16))
        bf = eng.read("brain")
        assert bf.dtype == np.float32 and np.allclose(bf, values, rtol=1e-2), bf
        # Each rank filled only the ranges it owns: together, every element once.
        assert eng.global_sum(sum(c for _, c in calls)) == 15, calls
        assert np.array_equal(eng.read(pcb), np.arange(15, dtype=np.float32).reshape(5, 3))
        eng.write(pcb, np.full((5, 3), 2.0, np.float32))
        assert np.array_equal(eng.read(pcb), np.full((5, 3), 2.0, np.float32))


def bad_input(swap_dir):
    expect_error(strata.InvalidArgument, "zero_optimization.stage", strata.Engine,
                 {"zero_optimization": {"stage": 7}})
    expect_error(strata.InvalidArgument, "strata_engine_create", strata.Engine, "{not json")
    with strata.Engine(config(swap_dir)) as eng:
        w = eng.register("w", np.ones((2, 3), np.float32))
        expect_error(strata.InvalidArgument, "already registered", eng.register, "w", np.ones(2, np.float32))
        e = expect_error(strata.InvalidArgument, "shape[1] is 0", eng.register, "empty", shape=(4, 0))
        assert "strata_register_param" in str(e) and e.status == 1
        expect_error(strata.InvalidArgument, "ndim 0", eng.register, "scalar", np.float32(1.0))
        expect_error(strata.InvalidArgument, "dtype", eng.register, "ints", np.arange(3))
        expect_error(strata.InvalidArgument, "params[0] = 5 is not a registered parameter id", eng.op, "bad", [5])
        expect_error(strata.InvalidArgument, "listed twice", eng.op, "twice", [w, w])
        op = eng.op("op", [w])
        expect_error(strata.InvalidState, "before strata_finalize", eng.fetch, op, "forward")
        expect_error(strata.InvalidState, "before strata_finalize", eng.step, 0.1)
        eng.finalize()
        expect_error(strata.InvalidState, "after strata_finalize", eng.register, "late", np.ones(2, np.float32))
        expect_error(strata.InvalidState, "called twice", eng.finalize)
        expect_error(strata.InvalidArgument, "operator id 42 is not registered", eng.fetch, 42, "forward")
        expect_error(strata.InvalidArgument, "phase 7", eng.fetch, op, 7)
        with eng.fetch(op, "forward") as win:
            e = expect_error(strata.InvalidState, "no operator fetched for backward", win.grad, w)
            assert "strata_grad_ptr" in str(e)
            expect_error(strata.InvalidState, "still fetched", eng.step, 0.1)
            expect_error(strata.InvalidState, "already fetched", eng.fetch, op, "backward")
            expect_error(strata.InvalidArgument, "parameter id 9 is not registered", eng.ptr, 9)
            expect_error(strata.InvalidArgument, "has 5 elements", eng.add_grad, w, np.ones(5, np.float32))
        expect_error(strata.InvalidState, "not fetched", Window_release, eng, op)
        expect_error(strata.InvalidArgument, "lr is nan", eng.step, float("nan"))
        # All of that left the engine usable: a real step works.
        with eng.fetch(op, "backward") as win:
            win.add_grad(w, np.ones((2, 3), np.float32))
        assert eng.step(0.1).applied
        assert eng.stats()["failed"] == 0


def Window_release(eng, op):
    strata.Window(eng, op.id, strata.FORWARD).release()


def failure_is_sticky():
    # The swap directory cannot be created: finalize fails with an I/O error,
    # and every later call says the engine is unusable, repeating why.
    bad = "/proc/strata-no-such-dir"  # its parent exists (a missing parent is bad input, not an I/O error)
    with strata.Engine(config(bad)) as eng:
        w = eng.register("w", np.ones(4, np.float32))
        eng.op("op", [w])
        e = expect_error(strata.Error, "strata_finalize", eng.finalize)
        assert not isinstance(e, (strata.InvalidArgument, strata.InvalidState)), type(e)
        e = expect_error(strata.EngineFailed, "unusable after an earlier error", eng.global_sum, 1.0)
        assert "strata_finalize" in str(e)
        assert eng.stats()["failed"] == 1


def views_are_safe(swap_dir):
    # Window arrays never outlive the memory they show: after release (the buffers are reused) and after
    # close (freed) they are read-only copies; before the fix, writing one here crashed the process
    # (SIGSEGV after a step on NVMe, "free(): corrupted unsorted chunks" after close).
    with strata.Engine(config(swap_dir)) as eng:
        w = eng.register("w", np.arange(6, dtype=np.float32).reshape(2, 3))
        expect_error(strata.InvalidArgument, "complex64", eng.register, "c", np.ones(3, np.complex64))
        expect_error(strata.InvalidArgument, "<U1", eng.register, "s", np.array(["a", "b"]))
        lin = eng.op("lin", [w])
        eng.finalize()
        with eng.fetch(lin, "forward") as win:
            value = win.param(w)
            assert win.param(w) is value and not value.flags.writeable
        a = eng.fetch(lin, "backward")
        g = a.grad(w)
        assert a.grad(w) is g and g.flags.writeable
        g[...] += 1.0
        a.add_grad(w, np.full((2, 3), 0.5, np.float32))  # goes into g while g is out
        expect_error(strata.InvalidArgument, "complex64", a.add_grad, w, np.ones((2, 3), np.complex64))
        a.release()
        assert not g.flags.writeable
        assert eng.step(0.1).applied
        for write in (lambda: g.__setitem__(slice(None), 7), lambda: value.__setitem__(0, 7)):
            try:
                write()
            except ValueError:
                pass
            else:
                raise AssertionError("an array of a released window was writable")
        assert np.array_equal(g, np.full((2, 3), 1.5, np.float32))  # what this rank added
        assert np.array_equal(value, np.arange(6, dtype=np.float32).reshape(2, 3))  # as it was when fetched
        expect_error(strata.InvalidState, "released", a.grad, w)
        after = eng.read(w)
        assert not np.array_equal(after, value), "the gradient written back at release was not applied"
        win = eng.fetch(lin, "forward")
        held = win.param(w)
    # Closed with the window open: its array stays a readable, read-only copy.
    assert np.array_equal(held, after) and not held.flags.writeable
    try:
        held[0, 0] = 7
    except ValueError:
        pass
    else:
        raise AssertionError("an array of a closed engine was writable")
    if int(os.environ.get("RANK", "0")) == 0:
        print("views: arrays outlive release and close safely; complex and string values refused")


# ---- checkpoints, the step breakdown, the timeline --------------------------------------------


def shared_dir(name):
    """A directory every rank names alike (under `strata run` the ranks share MASTER_PORT)."""
    tag = os.environ.get("MASTER_PORT") if os.environ.get("WORLD_SIZE", "1") != "1" else str(os.getpid())
    return os.path.join(tempfile.gettempdir(), f"strata-python-test-{tag}-{name}")


def grad_of(step, shape):
    """A deterministic gradient for `step`, the same on every rank (they sum)."""
    n = int(np.prod(shape))
    return (np.sin(np.arange(n, dtype=np.float64) * 0.37 + step) * 0.1).astype(np.float32).reshape(shape)


def train_steps(eng, lin, params, first, count):
    for step in range(first, first + count):
        with eng.fetch(lin, "forward"):
            pass
        with eng.fetch(lin, "backward") as win:
            for p in params:
                win.add_grad(p, grad_of(step, p.shape))
        assert eng.step(0.01).applied


def make_model(eng, scale=1.0, wshape=(16, 33)):
    w = eng.register("fc.weight", np.full(wshape, scale, np.float32))
    b = eng.register("fc.bias", np.linspace(-1, 1, 16).astype(np.float32) * scale, dtype="bf16")
    lin = eng.op("fc", [w, b])
    eng.finalize()
    return lin, [w, b]


def checkpoints(swap_dir):
    ckpt = shared_dir("ckpt")
    try:
        with strata.Engine(config(swap_dir)) as eng:
            lin, params = make_model(eng)
            train_steps(eng, lin, params, 0, 3)
            saved = [eng.read(p) for p in params]
            eng.save_checkpoint(ckpt)
            assert os.path.isfile(os.path.join(ckpt, "step_00000003", "manifest.json"))
            e = expect_error(strata.InvalidArgument, "already holds a checkpoint of step 3", eng.save_checkpoint, ckpt)
            assert "strata_save_checkpoint" in str(e)
            train_steps(eng, lin, params, 3, 3)
            later = [eng.read(p) for p in params]
            assert not np.array_equal(later[0], saved[0])
            eng.save_checkpoint(ckpt)  # step 6; step 3 is removed once step 6 is complete
            # (Each rank's strata-rank<N>.lock says who owns the directory while it saves.)
            names = sorted(n for n in os.listdir(ckpt) if not n.endswith(".lock"))
            assert names == ["step_00000006"], names
            eng.load_checkpoint(ckpt)  # back to step 6 in place: nothing changes
            assert eng.stats()["steps"] == 6
            assert all(np.array_equal(eng.read(p), v) for p, v in zip(params, later))

        # A fresh engine (other initial values, stage 2, optimizer in CPU memory) loads it bit for
        # bit, moments included: three more steps there equal three more steps here.
        with strata.Engine(config(swap_dir + "-fresh")) as eng, strata.Engine(config(swap_dir + "-2", stage=2)) as eng2:
            lin, params = make_model(eng, scale=0.0)
            lin2, params2 = make_model(eng2, scale=5.0)
            eng.load_checkpoint(ckpt)
            eng2.load_checkpoint(os.path.join(ckpt, "step_00000006"))  # a step directory itself
            for e_, ps in ((eng, params), (eng2, params2)):
                assert e_.stats()["steps"] == 6
                for p, v in zip(ps, later):
                    got = e_.read(p)
                    assert got.dtype == v.dtype and np.array_equal(got.view(np.uint8), v.view(np.uint8)), p.name
            train_steps(eng, lin, params, 6, 3)
            train_steps(eng2, lin2, params2, 6, 3)
            assert all(np.array_equal(eng.read(a), eng2.read(b)) for a, b in zip(params, params2))
        if int(os.environ.get("RANK", "0")) == 0:
            print("checkpoints: saved at step 3 and 6, loaded bit for bit into fresh engines (stage 3 and 2)")
    finally:
        barrier_and_remove(ckpt)


def with_checksum(manifest):
    """`manifest` with its manifest_crc32 recomputed as strata computes it: the CRC-32 of its canonical JSON
    (keys sorted, no spaces) without that field."""
    body = {k: v for k, v in manifest.items() if k != "manifest_crc32"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return dict(body, manifest_crc32=f"{zlib.crc32(text.encode()):08x}")


def barrier_and_remove(path):
    # Every rank is done with `path` once each has destroyed its engines; rank 0 removes it
    # (the others may still be reading it otherwise: a throwaway engine is the barrier).
    with strata.Engine(config(path + "-barrier", stage=1)) as eng:
        eng.register("x", np.zeros(1, np.float32))
        eng.finalize()
        eng.global_sum(0)
        if eng.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        eng.global_sum(0)


def damage(path, how):
    if how == "truncate":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    else:  # flip one byte in the middle: same size, another CRC-32
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))


def checkpoint_bad_input(swap_dir):
    ckpt = shared_dir("bad")
    try:
        with strata.Engine(config(swap_dir)) as eng:
            lin, params = make_model(eng)
            train_steps(eng, lin, params, 0, 2)
            before = [eng.read(p) for p in params]
            missing = os.path.join(ckpt, "no-such-dir")
            e = expect_error(strata.InvalidArgument, "does not exist", eng.load_checkpoint, missing)
            assert missing in str(e) and "strata_load_checkpoint" in str(e)
            expect_error(strata.InvalidArgument, "dir is empty", eng.load_checkpoint, "")
            os.makedirs(os.path.join(ckpt, "empty"), exist_ok=True)
            expect_error(strata.InvalidArgument, "no checkpoint", eng.load_checkpoint, os.path.join(ckpt, "empty"))
            with eng.fetch(lin, "forward"):
                expect_error(strata.InvalidState, "still fetched", eng.save_checkpoint, ckpt)
            eng.save_checkpoint(os.path.join(ckpt, "good"))
            # Returned on this rank: every rank has let go of the directory.
            locks = [f for f in os.listdir(os.path.join(ckpt, "good")) if f.endswith(".lock")]
            assert not locks, f"lock files left after strata_save_checkpoint returned: {locks}"
            step_dir = os.path.join(ckpt, "good", "step_00000002")
            mine = os.path.join(step_dir, f"rank{eng.rank}")
            for how, file, needle in (("truncate", "params_fp32.bin", "bytes, the manifest says"),
                                      ("flip", "exp_avg_fp32.bin", "CRC-32"),
                                      ("truncate", "engine.json", "bytes, the manifest says")):
                copy = os.path.join(ckpt, f"{how}-{file}")
                if eng.rank == 0:
                    shutil.copytree(os.path.join(ckpt, "good"), copy)
                eng.global_sum(0)  # the copy exists for every rank
                target = os.path.join(copy, "step_00000002", f"rank{eng.rank}", file)
                damage(target, how)
                eng.global_sum(0)  # every rank damaged its file before any checks
                e = expect_error(strata.InvalidArgument, needle, eng.load_checkpoint, copy)
                assert target in str(e), str(e)
            # Another world size, other parameters, a manifest that does not parse.
            if eng.rank == 0:
                manifest = os.path.join(step_dir, "manifest.json")
                for name, edit in (("world", lambda m: m.update(world_size=m["world_size"] + 1)),
                                   ("params", lambda m: m["model"]["params"][0].__setitem__(2, [4, 4])),
                                   ("finetune", lambda m: m.update(model={"dtype": "bf16"}))):
                    dst = os.path.join(ckpt, name)
                    shutil.copytree(os.path.join(ckpt, "good"), dst)
                    with open(os.path.join(dst, "step_00000002", "manifest.json")) as f:
                        m = json.load(f)
                    edit(m)
                    with open(os.path.join(dst, "step_00000002", "manifest.json"), "w") as f:
                        json.dump(with_checksum(m), f)  # as a real checkpoint of that kind would be
                # An edit that does not fix the manifest's own checksum is detected.
                shutil.copytree(os.path.join(ckpt, "good"), os.path.join(ckpt, "edited"))
                with open(os.path.join(ckpt, "edited", "step_00000002", "manifest.json")) as f:
                    m = json.load(f)
                m["step"] = 1
                with open(os.path.join(ckpt, "edited", "step_00000002", "manifest.json"), "w") as f:
                    json.dump(m, f)
                shutil.copytree(os.path.join(ckpt, "good"), os.path.join(ckpt, "cut"))
                with open(os.path.join(ckpt, "cut", "step_00000002", "manifest.json"), "r+") as f:
                    f.truncate(40)
            eng.global_sum(0)
            world = eng.world_size
            expect_error(strata.InvalidArgument, f"was written by {world + 1} rank(s); this engine has {world}",
                         eng.load_checkpoint, os.path.join(ckpt, "world"))
            expect_error(strata.InvalidArgument,
                         "parameter 0 is 'fc.weight' fp32 [4,4] there, 'fc.weight' fp32 [16,33]",
                         eng.load_checkpoint, os.path.join(ckpt, "params"))
            expect_error(strata.InvalidArgument, "not written by strata_save_checkpoint", eng.load_checkpoint,
                         os.path.join(ckpt, "finetune"))
            expect_error(strata.InvalidArgument, "edited or is corrupt", eng.load_checkpoint, os.path.join(ckpt, "edited"))
            e = expect_error(strata.InvalidArgument, "not valid JSON", eng.load_checkpoint, os.path.join(ckpt, "cut"))
            assert os.path.join(ckpt, "cut", "step_00000002", "manifest.json") in str(e)
            # Nothing was loaded and the engine is usable: its values are its own, a step works.
            assert all(np.array_equal(eng.read(p), v) for p, v in zip(params, before))
            assert eng.stats()["failed"] == 0
            train_steps(eng, lin, params, 2, 1)
        # A checkpoint of other parameters into a fresh engine: refused before anything changes.
        with strata.Engine(config(swap_dir + "-other")) as eng:
            eng.register("fc.weight", np.zeros((16, 33), np.float32))
            eng.op("fc", [0])
            eng.finalize()
            expect_error(strata.InvalidArgument, "holds 2 parameters, this engine has 1", eng.load_checkpoint,
                         os.path.join(ckpt, "good"))
    finally:
        barrier_and_remove(ckpt)


def breakdown_and_trace(swap_dir):
    path = os.path.join(swap_dir + "-trace", "run.{rank}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with strata.Engine(config(swap_dir)) as eng:
        lin, params = make_model(eng)
        assert eng.step_breakdown().step == 0 and eng.step_breakdown().seconds == 0
        expect_error(strata.InvalidState, "no trace is being recorded", strata.trace_stop)
        with strata.trace(path):
            expect_error(strata.InvalidState, "already being recorded", strata.trace_start, path)
            train_steps(eng, lin, params, 0, 3)
        b = eng.step_breakdown()
        assert isinstance(b, strata.StepBreakdown) and b.step == 3 and b.applied == 1, b
        parts = b.compute_seconds + b.param_stall_seconds + b.grad_wait_seconds + b.optimizer_seconds + b.other_seconds
        assert b.seconds > 0 and abs(parts - b.seconds) < 1e-6 + 1e-3 * b.seconds, b
        assert b.windows == 2 and b.fetches >= 2 and b.gathers >= 2, b
        assert b.gathered_bytes >= 2 * (16 * 33 * 4 + 16 * 2), b  # w and b, forward and backward
        assert b.nvme_read_bytes > 0 and b.nvme_written_bytes > 0 and b.param_read_bytes > 0, b
        assert b.trace_followed == 1 and b.trace_dropped == 0, b  # step 3 follows the trace step 1 recorded
        stalls = eng.op_stalls()
        assert len(stalls) == b.stalled_windows and all(isinstance(s.op, strata.Op) for s in stalls), stalls
        assert all(s.phase in ("forward", "backward") and s.windows == 1 for s in stalls), stalls
        assert abs(sum(s.seconds for s in stalls) - b.param_stall_seconds) <= 1e-9 + 1e-6 * b.param_stall_seconds
        assert [s.seconds for s in stalls] == sorted((s.seconds for s in stalls), reverse=True), stalls
    rank = int(os.environ.get("RANK", "0"))
    with open(path.replace("{rank}", str(rank))) as f:
        timeline = json.load(f)
    names = {ev.get("name") for ev in timeline["traceEvents"]}
    assert {"strata_fetch", "strata_release", "strata_step"} <= names, sorted(n for n in names if n)
    expect_error(strata.InvalidArgument, "path is empty", strata.trace_start, "")
    expect_error(strata.IoError, "cannot create the trace file /proc/no-such-dir/t.", strata.trace_start,
                 "/proc/no-such-dir/t.json")
    if rank == 0:
        print(f"step breakdown: {b.seconds * 1e3:.2f} ms = compute {b.compute_seconds * 1e3:.2f} + stall "
              f"{b.param_stall_seconds * 1e3:.2f} + grad wait {b.grad_wait_seconds * 1e3:.2f} + optimizer "
              f"{b.optimizer_seconds * 1e3:.2f} + other {b.other_seconds * 1e3:.2f}; NVMe read {b.nvme_read_bytes} B, "
              f"written {b.nvme_written_bytes} B; trace: {len(timeline['traceEvents'])} events")
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


KILL_CHILD = r"""
import os, sys
import numpy as np
import strata
sys.path.insert(0, os.path.dirname(sys.argv[1]))
from test_engine import config, grad_of
swap, ckpt, expected = sys.argv[2], sys.argv[3], sys.argv[4]
with strata.Engine(config(swap)) as eng:
    w = eng.register("big", np.full((1024, 1024), 0.5, np.float32))
    op = eng.op("big", [w])
    eng.finalize()
    for step in range(1, 1000):
        with eng.fetch(op, "backward") as win:
            win.add_grad(w, grad_of(step, w.shape))
        eng.step(0.01)
        # What a load of step_<step> must give, durable before the checkpoint can exist.
        tmp = os.path.join(expected, f"{step}.npy.tmp")
        with open(tmp, "wb") as f:
            np.save(f, eng.read(w))
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, os.path.join(expected, f"{step}.npy"))
        eng.save_checkpoint(ckpt)
"""


def killed_mid_save(root):
    """kill -9 while strata_save_checkpoint writes: the previous checkpoint loads bit for bit."""
    import signal
    import subprocess
    import time

    here = os.path.abspath(__file__)
    landed_mid_save = 0
    for attempt in range(4):
        swap, ckpt, expected = (os.path.join(root, f"kill{attempt}-{n}") for n in ("swap", "ckpt", "expected"))
        os.makedirs(expected)
        child = subprocess.Popen([sys.executable, "-c", KILL_CHILD, here, swap, ckpt, expected])
        try:
            # Wait for a complete checkpoint, then for the next save to begin, and kill at once.
            deadline = time.monotonic() + 120
            target = None
            while time.monotonic() < deadline and child.poll() is None:
                steps = sorted(d for d in os.listdir(ckpt) if d.startswith("step_")) if os.path.isdir(ckpt) else []
                complete = [d for d in steps if os.path.exists(os.path.join(ckpt, d, "manifest.json"))]
                if complete and target is None:
                    target = int(complete[-1][5:]) + 1 + attempt  # later attempts: a few saves in
                if target is not None and any(int(d[5:]) >= target for d in steps):
                    break
                time.sleep(0.0005)
            child.send_signal(signal.SIGKILL)
            child.wait()
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        assert target is not None, f"the child saved no checkpoint (exit status {child.returncode})"
        incomplete = [d for d in os.listdir(ckpt) if not os.path.exists(os.path.join(ckpt, d, "manifest.json"))]
        landed_mid_save += bool(incomplete)
        with strata.Engine(config(os.path.join(root, f"kill{attempt}-load"))) as eng:
            w = eng.register("big", np.zeros((1024, 1024), np.float32))
            eng.op("big", [w])
            eng.finalize()
            eng.load_checkpoint(ckpt)
            step = eng.stats()["steps"]
            want = np.load(os.path.join(expected, f"{step}.npy"))
            assert step >= 1 and np.array_equal(eng.read(w).view(np.uint32), want.view(np.uint32)), step
        shutil.rmtree(os.path.join(root, f"kill{attempt}-swap"), ignore_errors=True)
    # The kill must have hit a save in progress at least once, or this tested nothing.
    assert landed_mid_save >= 1, "no kill landed while a checkpoint was being written"
    print(f"kill -9 during strata_save_checkpoint: {landed_mid_save} of 4 kills landed mid-save; the previous "
          "checkpoint loaded bit for bit each time")


def prepared_steps(swap_dir):
    """prepare_step (the optimizer overlapping backward) changes no result; misuse is an InvalidState."""
    with strata.Engine(config(swap_dir + "-a")) as plain, strata.Engine(config(swap_dir + "-b")) as prepared:
        lin, params = make_model(plain)
        lin2, params2 = make_model(prepared)
        for step in range(4):
            for eng, op, ps, prepare in ((plain, lin, params, False), (prepared, lin2, params2, True)):
                if prepare:
                    eng.prepare_step(0.01)
                with eng.fetch(op, "forward"):
                    pass
                with eng.fetch(op, "backward") as win:
                    for p in ps:
                        win.add_grad(p, grad_of(step, p.shape))
                assert eng.step(0.01).applied
        for a, b in zip(params, params2):
            assert np.array_equal(plain.read(a).view(np.uint8), prepared.read(b).view(np.uint8)), a.name
        prepared.prepare_step(0.01)
        expect_error(strata.InvalidState, "twice", prepared.prepare_step, 0.01)
        expect_error(strata.InvalidState, "between strata_prepare_step and strata_step", prepared.read, params2[0])
        prepared.zero_grad()  # abandons the prepared step
        prepared.read(params2[0])
    if int(os.environ.get("RANK", "0")) == 0:
        print("prepare_step: 4 steps bit for bit the unprepared engine's; misuse refused")


def main():
    root = tempfile.mkdtemp(prefix="strata-python-test-")
    try:
        print(f"strata {strata.version()} from {strata.library_path}", file=sys.stderr)
        linear_regression(os.path.join(root, "a"))
        dtypes_and_values(os.path.join(root, "b"))
        bad_input(os.path.join(root, "c"))
        checkpoints(os.path.join(root, "d"))
        checkpoint_bad_input(os.path.join(root, "e"))
        breakdown_and_trace(os.path.join(root, "f"))
        prepared_steps(os.path.join(root, "g"))
        views_are_safe(os.path.join(root, "h"))
        if os.environ.get("WORLD_SIZE", "1") == "1":
            failure_is_sticky()  # one rank: a peer's collectives would wait for the failed one
            killed_mid_save(root)  # one rank: the child is a job of its own
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("python tests: ok")


if __name__ == "__main__":
    main()
