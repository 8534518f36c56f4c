"""A three-turn chat against `ninfer-serve` with the official `openai` client: each turn's TTFT and cached tokens.
The first question shows a picture (a drawn shelf label): later turns read its tokens from the prefix cache too.

    python scripts/chat_demo.py                        # the built-in tiny checkpoint, CPU-friendly settings
    python scripts/chat_demo.py -- /path/to/Qwen3.5-27B --dtype bfloat16   # any ninfer-serve arguments

It starts the server as a subprocess on a free loopback port, waits for /health/ready, runs the conversation
(streaming, with `stream_options.include_usage`, so TTFT is the client's time to the first token and
`cached_tokens` is what the prefix cache reused), then stops the server with SIGTERM and waits for it to
exit. The built-in checkpoint has random weights: its words are noise; the numbers are the point.
"""

from __future__ import annotations

import argparse
import base64
import io
import sys
import time

import numpy as np
import openai
from PIL import Image

from ninfer_jax.server.subprocess_server import ServerProcess

# Short context and chunk: the tiny model on a CPU decodes in milliseconds at these sizes.
DEFAULT_SERVER_ARGS = ["--max-model-len", "4096", "--prefill-chunk", "256"]
SYSTEM = ("You are a concise assistant for a hardware store. Answer in one or two sentences, name the aisle "
          "when you mention a product, and never invent prices. The store sells tools, paint, garden "
          "supplies, plumbing parts and electrical fittings; it opens at eight and closes at six. "
          "Aisle 1 holds hand tools, aisle 2 power tools, aisle 3 fasteners and adhesives, aisle 4 paint and "
          "finishes, aisle 5 abrasives, aisle 6 clamps and vises, aisle 7 plumbing, aisle 8 electrical, and the "
          "garden centre is outside the back door. Returns need a receipt and are accepted within thirty days; "
          "special orders take a week. Staff can cut wood and keys and mix paint to a sample while you wait.")
# A long enough system block that its 64-token blocks and the opener tap are visibly reused turn after turn.
QUESTIONS = ["Is this label from the glue shelf?", "And sandpaper for it?", "Which aisle has the cheapest clamps?"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("server_args", nargs="*", help="ninfer-serve arguments (after --)")
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    server = ServerProcess(args.server_args or DEFAULT_SERVER_ARGS)
    print("starting |", " ".join(server.command), flush=True)
    with server:
        _chat(server.url, args.max_tokens)
    print(f"server stopped | exit status {server.exit_status}")
    return 0 if server.exit_status == 0 else 1


def shelf_picture() -> str:
    """A small drawn picture (coloured stripes, a shelf label's colours) as a data URL."""
    y, x = np.mgrid[:96, :160]
    pixels = np.stack([(x * 3) % 256, (y * 5) % 256, ((x // 20 + y // 24) % 2) * 200], axis=-1).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def _chat(url: str, max_tokens: int) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    messages = [{"role": "system", "content": SYSTEM}]
    for turn, question in enumerate(QUESTIONS, 1):
        if turn == 1:  # a model without a vision tower would answer 400: the demo's checkpoint has one
            messages.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": shelf_picture()}},
                                                         {"type": "text", "text": question}]})
        else:
            messages.append({"role": "user", "content": question})
        started = time.perf_counter()
        ttft = None
        answer, reasoning, usage = [], [], None
        stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                temperature=0, stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            thought = (delta.model_extra or {}).get("reasoning_content")
            if ttft is None and (delta.content or thought):
                ttft = time.perf_counter() - started
            answer.append(delta.content or "")
            reasoning.append(thought or "")
        text = "".join(answer)
        messages.append({"role": "assistant", "content": text})
        shown = (text or "".join(reasoning)).replace("\n", " ")[:60]
        print(f"turn {turn} | prompt {usage.prompt_tokens} tokens | cached {usage.prompt_tokens_details.cached_tokens} "
              f"| TTFT {ttft * 1000:.0f} ms | {usage.completion_tokens} tokens out | {shown!r}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
