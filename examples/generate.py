"""Generate an answer with the embedded default model through cachedrag's runner.

Run: .venv/bin/python examples/generate.py
"""

from cachedrag.model import ModelRunner, SamplingParams, TextGenerator, load_model
from cachedrag.model.textgen import chat_ids, chat_messages

model, tokenizer = load_model()
runner = ModelRunner(model, tokenizer)
ids = chat_ids(tokenizer, chat_messages("What does heapq.heappush do?", "You are a helpful assistant. Be brief."))
generator = TextGenerator(runner)
for delta in generator.stream(ids, SamplingParams(max_new_tokens=48)):
    print(delta, end="", flush=True)
print(f"\n(TTFT {generator.last_result.ttft_s * 1000:.0f} ms, {generator.last_result.prompt_tokens} prompt tokens)")
