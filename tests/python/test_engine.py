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
  - an I/O failure leaves the engine unusable: later calls raise EngineFailed.
Prints "python tests: ok" on success (CTest matches it).
"""

import os
import shutil
import sys
import tempfile

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
    bad = "/proc/strata-no-such-dir/swap"
    with strata.Engine(config(bad)) as eng:
        w = eng.register("w", np.ones(4, np.float32))
        eng.op("op", [w])
        e = expect_error(strata.Error, "strata_finalize", eng.finalize)
        assert not isinstance(e, (strata.InvalidArgument, strata.InvalidState)), type(e)
        e = expect_error(strata.EngineFailed, "unusable after an earlier error", eng.global_sum, 1.0)
        assert "strata_finalize" in str(e)
        assert eng.stats()["failed"] == 1


def main():
    root = tempfile.mkdtemp(prefix="strata-python-test-")
    try:
        print(f"strata {strata.version()} from {strata.library_path}", file=sys.stderr)
        linear_regression(os.path.join(root, "a"))
        dtypes_and_values(os.path.join(root, "b"))
        bad_input(os.path.join(root, "c"))
        if os.environ.get("WORLD_SIZE", "1") == "1":
            failure_is_sticky()  # one rank: a peer's collectives would wait for the failed one
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("python tests: ok")


if __name__ == "__main__":
    main()
