"""`strata data prepare`: JSONL as people fine-tune on -> strata's prepared-data
format (prepared_format.py): the model's own tokenizer (tokenizer.json, read
by Hugging Face's `tokenizers`) and chat template (tokenizer_config.json's
chat_template, or chat_template.jinja, rendered with Jinja2 as transformers
renders it), a loss-mask bit per token, document boundaries.

Formats of the input, one JSON object per line:
  chat               {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": "..."}, ...]}
                     rendered by the chat template; only the assistant turns are
                     trained: for assistant message i, the characters that
                     rendering messages[:i+1] adds to rendering messages[:i]
                     with the generation prompt (its content and end of turn),
                     and a token is trained when it overlaps one of them (as
                     transformers' assistant-tokens mask).
  prompt-completion  {"prompt": "...", "completion": "..."}: the prompt
                     tokenized with the tokenizer's special tokens (e.g. BOS),
                     the completion without, then EOS; only the completion
                     and EOS are trained.
  text               {"text": "..."}: tokenized with the special tokens, then
                     EOS; every token trained.

Needs `tokenizers` and `jinja2`: when this Python lacks them, the command
makes a virtual environment (--venv DIR, else $STRATA_DATA_VENV, else
~/.cache/strata/data-venv), installs them there from PyPI and runs in it.
A malformed line is refused naming FILE:LINE and what is wrong; nothing is
written then.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import prepared_format  # noqa: E402

PROG = "strata data prepare"
REQUIREMENTS = ["tokenizers", "jinja2"]


class Refused(Exception):
    pass


def refuse(message):
    raise Refused(message)


# ---- the environment --------------------------------------------------------------------

def have_requirements():
    try:
        import jinja2  # noqa: F401
        import tokenizers  # noqa: F401
        return True
    except ImportError:
        return False


def default_venv():
    return os.environ.get("STRATA_DATA_VENV") or os.path.join(os.path.expanduser("~"), ".cache", "strata",
                                                              "data-venv")


def ensure_environment(venv):
    """Returns normally when this interpreter can run; else re-executes in the venv."""
    if venv is None and have_requirements():
        return
    venv = os.path.abspath(venv or default_venv())
    python = os.path.join(venv, "bin", "python")
    if os.path.realpath(sys.prefix) == os.path.realpath(venv):
        if have_requirements():
            return
    else:
        if os.path.exists(python) and subprocess.run([python, "-c", "import tokenizers, jinja2"],
                                                     capture_output=True).returncode == 0:
            os.execv(python, [python, os.path.abspath(__file__)] + sys.argv[1:])
    print(f"{PROG}: installing {' and '.join(REQUIREMENTS)} into the virtual environment {venv} (once)",
          file=sys.stderr)
    if not os.path.exists(python):
        r = subprocess.run([sys.executable, "-m", "venv", venv])
        if r.returncode != 0:
            refuse(f"--venv {venv}: cannot create a virtual environment there "
                   "(Debian: apt-get install python3-venv)")
    r = subprocess.run([python, "-m", "pip", "install", "-q"] + REQUIREMENTS)
    if r.returncode != 0:
        refuse(f"--venv {venv}: pip could not install {' '.join(REQUIREMENTS)} there")
    os.execv(python, [python, os.path.abspath(__file__)] + sys.argv[1:])


# ---- the model's tokenizer and template --------------------------------------------------

def token_text(value):
    """A special token of tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class ModelText:
    """tokenizer.json, the special tokens and the chat template of HF_DIR."""

    def __init__(self, model_dir, need_template):
        from tokenizers import Tokenizer
        tok_path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(tok_path):
            refuse(f"--model {model_dir}: no tokenizer.json (the fast tokenizer file of the model)")
        try:
            self.tokenizer = Tokenizer.from_file(tok_path)
        except Exception as e:  # the library's own parse error
            refuse(f"{tok_path}: not a tokenizer file the tokenizers library reads: {e}")
        cfg_path = os.path.join(model_dir, "tokenizer_config.json")
        self.config = {}
        if os.path.isfile(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                try:
                    self.config = json.load(f)
                except json.JSONDecodeError as e:
                    refuse(f"{cfg_path}: not JSON: {e}")
        self.special = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            text = token_text(self.config.get(key))
            if text is not None:
                self.special[key] = text
        extra = self.config.get("additional_special_tokens")
        if extra:
            self.special["additional_special_tokens"] = [token_text(t) for t in extra]
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.template = None
        if need_template:
            self.template = self._load_template(model_dir, cfg_path)

    def eos_id(self):
        eos = self.special.get("eos_token")
        if eos is None:
            refuse("the model's tokenizer_config.json names no eos_token (appended to each document)")
        i = self.tokenizer.token_to_id(eos)
        if i is None:
            refuse(f"eos_token {eos!r} of tokenizer_config.json is not in tokenizer.json's vocabulary")
        return i

    def _load_template(self, model_dir, cfg_path):
        jinja_path = os.path.join(model_dir, "chat_template.jinja")
        source = None
        if os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                source = f.read()
        else:
            source = self.config.get("chat_template")
            if isinstance(source, list):  # named templates: the default one
                named = {t.get("name"): t.get("template") for t in source}
                source = named.get("default")
        if not source:
            refuse(f"--model {model_dir}: no chat template (neither chat_template.jinja nor chat_template in "
                   "tokenizer_config.json); use --format prompt-completion or text")
        return compile_template(source)

    def render(self, messages, add_generation_prompt):
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                    tools=None, documents=None, **self.special)


def compile_template(source):
    """The template compiled as transformers compiles it (same environment and helpers)."""
    import datetime
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = dict
    env.globals["namespace"] = jinja2.utils.Namespace
    return env.from_string(source)


# ---- one document per line --------------------------------------------------------------

ROLES = ("system", "user", "assistant", "tool")


def chat_document(text, record, where):
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        refuse(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            refuse(f"{where}: message {k} must be an object with string \"role\" and \"content\"")
        if m["role"] not in ROLES:
            refuse(f"{where}: message {k} has role {m['role']!r} (expected one of {', '.join(ROLES)})")
    assistant = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistant:
        refuse(f"{where}: no assistant message, so nothing to train on")
    try:
        full = text.render(messages, add_generation_prompt=False)
        spans = []
        for k in assistant:
            before = text.render(messages[:k], add_generation_prompt=True)
            through = text.render(messages[:k + 1], add_generation_prompt=False)
            if not through.startswith(before) or not full.startswith(through):
                refuse(f"{where}: the chat template does not render this conversation turn by turn (message "
                       f"{k}): the assistant tokens cannot be told apart")
            spans.append((len(before), len(through)))
    except Refused:
        raise
    except Exception as e:  # jinja2's TemplateError, raise_exception() of the template
        refuse(f"{where}: the chat template refused the conversation: {e}")
    enc = text.tokenizer.encode(full, add_special_tokens=False)
    # A token is trained when its characters overlap an assistant span (transformers' assistant mask).
    mask = [False] * len(enc.ids)
    span = 0
    for t, (first, end) in enumerate(enc.offsets):
        while span < len(spans) and first >= spans[span][1]:
            span += 1
        if span == len(spans):
            break
        if end > spans[span][0]:
            mask[t] = True
    return list(enc.ids), mask


def string_field(record, key, where):
    value = record.get(key)
    if not isinstance(value, str):
        refuse(f"{where}: \"{key}\" must be a string" + ("" if key in record else " (missing)"))
    return value


def prompt_completion_document(text, record, where):
    prompt = string_field(record, "prompt", where)
    completion = string_field(record, "completion", where)
    p = text.tokenizer.encode(prompt, add_special_tokens=True).ids
    c = text.tokenizer.encode(completion, add_special_tokens=False).ids + [text.eos_id()]
    return p + c, [False] * len(p) + [True] * len(c)


def text_document(text, record, where):
    ids = text.tokenizer.encode(string_field(record, "text", where), add_special_tokens=True).ids + [text.eos_id()]
    return ids, [True] * len(ids)


DOCUMENT = {"chat": chat_document, "prompt-completion": prompt_completion_document, "text": text_document}
KEYS = {"chat": {"messages"}, "prompt-completion": {"prompt", "completion"}, "text": {"text"}}


# Gemma3Config's image placeholders (its defaults when config.json leaves them out).
GEMMA3_IMAGE_TOKENS = (("image_token_index", 262144), ("boi_token_index", 255999), ("eoi_token_index", 256000))


def image_placeholders(model_dir):
    """{id: key} of the image placeholders of a gemma3 (Gemma3ForConditionalGeneration) model: strata trains its
    text model and cannot fill them."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError:
            return {}  # strata finetune names what is wrong with it
    if not isinstance(config, dict) or config.get("model_type") != "gemma3":
        return {}
    return {config.get(key, default): key for key, default in GEMMA3_IMAGE_TOKENS}


def refuse_image_placeholders(ids, placeholders, where):
    for t, token in enumerate(ids):
        if token in placeholders:
            refuse(f"{where}: token {t} of the document is {token}, the model's image placeholder "
                   f"({placeholders[token]} of config.json): strata trains the text model of a gemma3 checkpoint and "
                   "cannot fill images; remove the image from the line")


def prepare(args):
    text = ModelText(args.model, need_template=args.format == "chat")
    placeholders = image_placeholders(args.model)
    documents, truncated, targets, longest = [], 0, 0, 0
    with open(args.input, "rb") as f:
        for number, raw in enumerate(f, 1):
            where = f"{args.input}:{number}"
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                refuse(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})")
            except json.JSONDecodeError as e:
                refuse(f"{where}: not a JSON object: {e.msg} (column {e.colno})")
            if not isinstance(record, dict):
                refuse(f"{where}: a line must be a JSON object, got {type(record).__name__}")
            unknown = sorted(set(record) - KEYS[args.format])
            if unknown:
                refuse(f"{where}: key \"{unknown[0]}\" is not part of the {args.format} format (expected "
                       f"{', '.join(sorted(KEYS[args.format]))})")
            ids, mask = DOCUMENT[args.format](text, record, where)
            refuse_image_placeholders(ids, placeholders, where)
            longest = max(longest, len(ids))
            if args.max_length and len(ids) > args.max_length:
                ids, mask = ids[:args.max_length], mask[:args.max_length]
                truncated += 1
            if not any(mask[1:]):
                refuse(f"{where}: no token to train on" + (f" within --max-length {args.max_length}"
                                                            if args.max_length else ""))
            targets += sum(mask[1:])  # a document's first token is predicted from nothing
            documents.append((ids, mask))
    if not documents:
        refuse(f"{args.input}: no documents (the file is empty)")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    fd, tmp = tempfile.mkstemp(prefix=".prepare.", dir=out_dir)
    os.close(fd)
    try:
        prepared_format.write(tmp, documents, text.vocab_size)
        os.replace(tmp, args.out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    tokens = sum(len(ids) for ids, _ in documents)
    print(f"{PROG}: {args.out}: {len(documents)} documents, {tokens} tokens, {targets} trained "
          f"({100.0 * (tokens - targets) / tokens:.1f}% masked out), longest document {longest} tokens, "
          f"{truncated} truncated" + (f" to --max-length {args.max_length}" if args.max_length else ""))


def main(argv=None):
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="Hugging Face model directory (tokenizer.json, "
                        "tokenizer_config.json, chat_template.jinja)")
    parser.add_argument("--input", required=True, help="JSONL file, one document per line")
    parser.add_argument("--format", required=True, choices=sorted(DOCUMENT))
    parser.add_argument("--out", required=True, help="prepared-data file to write")
    parser.add_argument("--max-length", type=int, default=0, help="cut documents to this many tokens (0: none)")
    parser.add_argument("--venv", help="virtual environment with tokenizers and jinja2 (made if missing)")
    if argv is None and "--setup-only" in sys.argv[1:]:
        # Make the environment and stop (the test suite's fixture).
        setup = argparse.ArgumentParser(prog=PROG)
        setup.add_argument("--venv", required=True)
        setup.add_argument("--setup-only", action="store_true")
        try:
            ensure_environment(setup.parse_args().venv)
        except Refused as e:
            print(f"{PROG}: {e}", file=sys.stderr)
            return 1
        print(f"{PROG}: the environment has tokenizers and jinja2")
        return 0
    args = parser.parse_args(argv)
    try:
        if args.max_length < 0:
            refuse(f"--max-length must be >= 0, got {args.max_length}")
        ensure_environment(args.venv)
        if not os.path.isdir(args.model):
            refuse(f"--model {args.model}: not a directory")
        if not os.path.isfile(args.input):
            refuse(f"--input {args.input}: no such file")
        prepare(args)
    except Refused as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
