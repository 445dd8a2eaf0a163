"""strata finetune's tensorboard and csv_monitor files, read back.

argv: the strata binary, the source tree. Runs a 3-step finetune with both
monitors on, then reads the event file with protobuf (Debian's python3-protobuf,
the module protoc generates from runtime/train/tensorboard/event.proto — the
library that wrote it), checking the TFRecord framing's CRC-32Cs, the file
version event, and that every scalar equals the CSV monitor's value.
"""
import csv
import glob
import os
import struct
import subprocess
import sys
import tempfile

strata, source = sys.argv[1:3]


def crc32c(data):
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def masked(data):
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


with tempfile.TemporaryDirectory() as tmp:
    config = os.path.join(tmp, "ds.json")
    with open(config, "w") as f:
        f.write('{"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},'
                f' "tensorboard": {{"enabled": true, "output_path": "{tmp}/tb", "job_name": "job"}},'
                f' "csv_monitor": {{"enabled": true, "output_path": "{tmp}/csv", "job_name": "job"}}}}')
    model = os.path.join(tmp, "m.json")
    with open(model, "w") as f:
        f.write('{"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,'
                ' "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64,'
                ' "rms_norm_eps": 1e-5}')
    r = subprocess.run([strata, "finetune", "--config", config, "--init", model, "--data",
                        os.path.join(source, "examples", "finetune", "data", "gpl-3.0.txt"), "--data-format", "text",
                        "--seq", "32", "--steps", "3", "--out", os.path.join(tmp, "out")],
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"finetune failed:\n{r.stdout}\n{r.stderr}")
    subprocess.run(["protoc", f"--proto_path={source}/runtime/train/tensorboard", f"--python_out={tmp}",
                    "event.proto"], check=True)
    sys.path.insert(0, tmp)
    import event_pb2  # noqa: E402

    files = glob.glob(os.path.join(tmp, "tb", "job", "events.out.tfevents.*"))
    assert len(files) == 1, files
    with open(files[0], "rb") as f:
        data = f.read()
    events, at = [], 0
    while at < len(data):
        header = data[at:at + 8]
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", data[at + 8:at + 12])
        assert length_crc == masked(header), f"record at {at}: length CRC"
        body = data[at + 12:at + 12 + length]
        (body_crc,) = struct.unpack("<I", data[at + 12 + length:at + 16 + length])
        assert body_crc == masked(body), f"record at {at}: data CRC"
        e = event_pb2.Event()
        e.ParseFromString(body)
        events.append(e)
        at += 16 + length
    assert events[0].file_version == "brain.Event:2", events[0]
    scalars = {}
    for e in events[1:]:
        for v in e.summary.value:
            scalars[(v.tag, e.step)] = v.simple_value
    tags = {t for t, _ in scalars}
    assert tags == {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_second"}, tags
    for tag in ("train/loss", "train/lr", "train/grad_norm"):
        with open(os.path.join(tmp, "csv", "job", tag.replace("/", "_") + ".csv")) as f:
            rows = list(csv.reader(f))
        assert rows[0] == ["step", tag], rows[0]
        assert len(rows) == 4, rows
        for step, value in rows[1:]:
            got = scalars[(tag, int(step))]
            assert abs(got - float(value)) <= 1e-6 * max(1.0, abs(float(value))), (tag, step, got, value)
    print(f"tensorboard: {len(events)} events, tags {sorted(tags)}; equal to csv_monitor's values")
