#!/usr/bin/env python3
"""`import strata` before `import torch`: strata links no NCCL (it loads one when it makes a cuda
communicator, preferring one already in the process), so it cannot put a libnccl.so.2 into the process
ahead of torch's -- on a CUDA build that older NCCL shadowed torch's and `import torch` failed on
ncclCommResume. Checked here: no strata library the process loaded needs libnccl (readelf), torch imports
after strata and trains a wrapped model. What needs a GPU (a cuda engine's NCCL communicator created after
torch's NCCL is loaded, and sharing it) is not run here."""

import pathlib
import subprocess
import sys

sys.dont_write_bytecode = True
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "python"))

import strata  # noqa: E402  -- first, on purpose

assert "torch" not in sys.modules, "something imported torch before this test could"


def loaded_strata_libraries():
    libraries = set()
    for line in pathlib.Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        if "libstrata_" in path and path.endswith(".so"):
            libraries.add(path)
    return sorted(libraries)


def needed(path):
    out = subprocess.run(["readelf", "-d", path], check=True, capture_output=True, text=True).stdout
    return [line.split("[")[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]


def main():
    libraries = loaded_strata_libraries()
    assert any("libstrata_runtime" in p for p in libraries), libraries
    for path in libraries:
        nccl = [n for n in needed(path) if "nccl" in n]
        assert not nccl, f"{path} needs {nccl}: it would load NCCL before torch does"
    import torch  # noqa: E402  -- after strata
    import common  # noqa: E402
    import strata.torch as st  # noqa: E402
    model = common.gpt2()
    want, _ = common.reference_losses(model, 2)
    st.wrap(model, common.config())
    opt = st.Optimizer(model)
    got = []
    for step in range(2):
        loss = model(**common.batch(step)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        got.append(loss.item())
    common.check_losses("import strata, then torch", got, want)
    print(f"test_import_order: ok ({len(libraries)} strata libraries loaded before torch {torch.__version__}, "
          f"none needs libnccl; {strata.library_path})")


if __name__ == "__main__":
    main()
