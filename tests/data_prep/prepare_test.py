"""`strata data prepare` as a user runs it, against transformers' own output.

argv: the strata binary, the source tree, the data venv (tokenizers + jinja2).
Exact: for every line of tests/data/chat/inputs_*.jsonl the prepared tokens
equal transformers' input_ids and the loss mask equals its assistant-tokens
mask (chat) or the prompt/completion split (tests/data/chat/expected.json,
written by scripts/make-golden-chat). Refused, naming file:line: lines that
are not JSON, not objects, miss a field, carry an unknown key or a bad role.
"""
import json
import os
import subprocess
import sys
import tempfile

strata, source, venv = sys.argv[1:4]
sys.path.insert(0, os.path.join(source, "python", "strata_data"))
import prepared_format  # noqa: E402

MODEL = os.path.join(source, "tests", "data", "tokenizer", "smollm2")
CHAT = os.path.join(source, "tests", "data", "chat")
failures = []


def prepare(input_path, fmt, out, extra=()):
    return subprocess.run([strata, "data", "prepare", "--model", MODEL, "--input", input_path, "--format", fmt,
                           "--out", out, "--venv", venv, *extra], capture_output=True, text=True)


def check(condition, what):
    if not condition:
        failures.append(what)
        print("FAILED:", what)


with open(os.path.join(CHAT, "expected.json"), encoding="utf-8") as f:
    expected = json.load(f)

with tempfile.TemporaryDirectory() as tmp:
    for fmt, name in (("chat", "chat"), ("prompt-completion", "prompt_completion"), ("text", "text")):
        out = os.path.join(tmp, f"{name}.sd")
        r = prepare(os.path.join(CHAT, f"inputs_{name}.jsonl"), fmt, out)
        check(r.returncode == 0, f"{fmt}: exit {r.returncode}: {r.stderr}")
        if r.returncode != 0:
            continue
        want = expected[fmt]
        check(f"{len(want)} documents" in r.stdout and "masked out" in r.stdout and "longest document" in r.stdout,
              f"{fmt}: the summary says documents, masked share, longest: {r.stdout!r}")
        docs, vocab = prepared_format.read(out)
        check(vocab == expected["vocab_size"], f"{fmt}: vocab {vocab} != {expected['vocab_size']}")
        check(len(docs) == len(want), f"{fmt}: {len(docs)} documents, expected {len(want)}")
        for i, ((ids, mask), w) in enumerate(zip(docs, want)):
            check(ids == w["input_ids"], f"{fmt} line {i + 1}: tokens differ from transformers'\n  ours {ids}\n"
                                         f"  want {w['input_ids']}")
            check([int(b) for b in mask] == w["mask"], f"{fmt} line {i + 1}: mask differs from transformers'\n"
                                                       f"  ours {[int(b) for b in mask]}\n  want {w['mask']}")
        trained = sum(sum(w["mask"][1:]) for w in want)
        tokens = sum(len(w["input_ids"]) for w in want)
        print(f"{fmt}: {len(want)} documents, {tokens} tokens, {trained} trained: tokens and mask equal "
              "transformers'")

    # --max-length cuts and counts.
    out = os.path.join(tmp, "cut.sd")
    r = prepare(os.path.join(CHAT, "inputs_chat.jsonl"), "chat", out, ["--max-length", "50"])
    check(r.returncode == 0 and "2 truncated" in r.stdout, f"--max-length 50: {r.stdout!r} {r.stderr!r}")

    # Malformed lines: refused naming file:line, nothing written.
    bad = {
        "notjson": ('{"messages": [}\n', "chat", ":1: not a JSON object"),
        "array": ('{"text": "ok"}\n[1, 2]\n', "text", ":2: a line must be a JSON object"),
        "missing": ('{"prompt": "a"}\n', "prompt-completion", ':1: "completion" must be a string (missing)'),
        "unknown": ('{"text": "a", "label": 1}\n', "text", ':1: key "label" is not part of the text format'),
        "role": ('{"messages": [{"role": "robot", "content": "x"}]}\n', "chat", ":1: message 0 has role 'robot'"),
        "noassistant": ('\n{"messages": [{"role": "user", "content": "x"}]}\n', "chat", ":2: no assistant message"),
    }
    for name, (text, fmt, message) in bad.items():
        path = os.path.join(tmp, f"{name}.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        out = os.path.join(tmp, f"{name}.sd")
        r = prepare(path, fmt, out)
        check(r.returncode == 1 and (path + message) in r.stderr, f"{name}: exit {r.returncode}, {r.stderr!r}")
        check(not os.path.exists(out), f"{name}: a refused input wrote {out}")
    # A model directory without a template, asked for chat.
    r = prepare(os.path.join(CHAT, "inputs_chat.jsonl"), "chat", os.path.join(tmp, "x.sd"))
    os.makedirs(os.path.join(tmp, "no_template"))
    with open(os.path.join(MODEL, "tokenizer.json"), "rb") as src, \
            open(os.path.join(tmp, "no_template", "tokenizer.json"), "wb") as dst:
        dst.write(src.read())
    r = subprocess.run([strata, "data", "prepare", "--model", os.path.join(tmp, "no_template"), "--input",
                        os.path.join(CHAT, "inputs_chat.jsonl"), "--format", "chat", "--out",
                        os.path.join(tmp, "y.sd"), "--venv", venv], capture_output=True, text=True)
    check(r.returncode == 1 and "no chat template" in r.stderr, f"no template: {r.stderr!r}")

    # A gemma3 (Gemma3ForConditionalGeneration) model: a line whose tokens hold
    # an image placeholder id is refused naming file:line; the others prepare.
    gemma3 = os.path.join(tmp, "gemma3")
    os.makedirs(gemma3)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(MODEL, name), "rb") as src, open(os.path.join(gemma3, name), "wb") as dst:
            dst.write(src.read())
    probe = subprocess.run([os.path.join(venv, "bin", "python"), "-c",
                            "import sys, tokenizers; t = tokenizers.Tokenizer.from_file(sys.argv[1]); "
                            "print(t.encode('picture', add_special_tokens=False).ids[0])",
                            os.path.join(MODEL, "tokenizer.json")], capture_output=True, text=True)
    check(probe.returncode == 0, f"tokenizing 'picture': {probe.stderr!r}")
    if probe.returncode == 0:
        boi = int(probe.stdout)
        with open(os.path.join(gemma3, "config.json"), "w", encoding="utf-8") as f:
            json.dump({"model_type": "gemma3", "boi_token_index": boi, "text_config": {}}, f)
        path = os.path.join(tmp, "image.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            f.write('{"text": "words"}\n{"text": "picture"}\n')
        out = os.path.join(tmp, "image.sd")
        r = subprocess.run([strata, "data", "prepare", "--model", gemma3, "--input", path, "--format", "text",
                            "--out", out, "--venv", venv], capture_output=True, text=True)
        check(r.returncode == 1 and f"{path}:2: token" in r.stderr and f"is {boi}, the model's image placeholder "
              "(boi_token_index" in r.stderr, f"gemma3 image placeholder: {r.stderr!r}")
        check(not os.path.exists(out), "a refused input wrote image.sd")
        with open(path, "w", encoding="utf-8") as f:
            f.write('{"text": "words"}\n')
        r = subprocess.run([strata, "data", "prepare", "--model", gemma3, "--input", path, "--format", "text",
                            "--out", out, "--venv", venv], capture_output=True, text=True)
        check(r.returncode == 0, f"gemma3 text only: {r.stderr!r}")

if failures:
    print(f"{len(failures)} failure(s)")
    sys.exit(1)
print("data prepare: all checks passed")
