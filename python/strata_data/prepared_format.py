"""strata's prepared-data format: tokens, a loss-mask bit per token and document
boundaries, written by `strata data prepare` and read by `strata finetune`
(runtime/data/prepared_file.h is the C++ reader; docs/DESIGN.md describes it).

Layout, all integers little-endian:

  offset 0   8 bytes   magic b"STRATAPD"
         8   u32       version (1)
        12   u32       header bytes (64)
        16   u64       N, the token count
        24   u64       D, the document count
        32   u64       V, the vocabulary size of the tokenizer (every id < V)
        40   24 bytes  zero
        64   u32 x N   token ids, documents one after another
             u8 x ceil(N / 8)   loss mask: bit (t % 8) of byte t // 8 is 1 when
                       token t is a training target (predicted from the tokens
                       before it in its document), 0 when it is context only
             zero bytes up to a multiple of 8
             u64 x (D + 1)  document offsets: 0, the start of document 1, ...,
                       N; strictly increasing (no empty document)

The file size is exactly what N and D say, so a truncated file is refused.
Stdlib only: the reader is used by the tests.
"""
import struct

MAGIC = b"STRATAPD"
VERSION = 1
HEADER_BYTES = 64


def layout(n_tokens, n_docs):
    """(mask offset, offsets offset, file size) for N tokens and D documents."""
    mask_at = HEADER_BYTES + 4 * n_tokens
    offsets_at = (mask_at + (n_tokens + 7) // 8 + 7) // 8 * 8
    return mask_at, offsets_at, offsets_at + 8 * (n_docs + 1)


def write(path, documents, vocab_size):
    """documents: list of (ids, mask) with equal lengths, mask of bools."""
    tokens, bits, offsets = [], [], [0]
    for ids, mask in documents:
        assert len(ids) == len(mask) and len(ids) > 0
        tokens.extend(ids)
        bits.extend(mask)
        offsets.append(len(tokens))
    n, d = len(tokens), len(documents)
    mask_at, offsets_at, size = layout(n, d)
    mask_bytes = bytearray((n + 7) // 8)
    for t, bit in enumerate(bits):
        if bit:
            mask_bytes[t // 8] |= 1 << (t % 8)
    header = MAGIC + struct.pack("<IIQQQ", VERSION, HEADER_BYTES, n, d, vocab_size)
    header += b"\0" * (HEADER_BYTES - len(header))
    body = struct.pack(f"<{n}I", *tokens) + bytes(mask_bytes)
    body += b"\0" * (offsets_at - HEADER_BYTES - len(body))
    body += struct.pack(f"<{d + 1}Q", *offsets)
    assert HEADER_BYTES + len(body) == size
    with open(path, "wb") as f:
        f.write(header + body)


def read(path):
    """(documents as (ids, mask) lists, vocab_size); raises ValueError naming what is wrong."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < HEADER_BYTES or data[:8] != MAGIC:
        raise ValueError(f"{path}: not a strata prepared-data file (no {MAGIC!r} magic)")
    version, header_bytes, n, d, vocab = struct.unpack_from("<IIQQQ", data, 8)
    if version != VERSION or header_bytes != HEADER_BYTES:
        raise ValueError(f"{path}: version {version} is not supported (expected {VERSION})")
    mask_at, offsets_at, size = layout(n, d)
    if len(data) != size:
        raise ValueError(f"{path}: {len(data)} bytes, but its header says {size} (truncated or corrupt)")
    tokens = struct.unpack_from(f"<{n}I", data, HEADER_BYTES)
    bits = [bool(data[mask_at + t // 8] >> (t % 8) & 1) for t in range(n)]
    offsets = struct.unpack_from(f"<{d + 1}Q", data, offsets_at)
    docs = [(list(tokens[a:b]), bits[a:b]) for a, b in zip(offsets, offsets[1:])]
    return docs, vocab
