"""Drives a running rollout worker through the official `openai` Python client, as another
trainer's agent loop would, and prints what it read as one JSON object for
`tests/openai_api.rs` to check against the worker's gRPC API.

    PYTHONPATH=<openai install> python3 openai_client.py http://127.0.0.1:PORT AGENT
"""

import json
import sys

import openai

base, agent = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base + "/v1", api_key="not-checked", max_retries=0)
messages = [{"role": "user", "content": "hello"}]
sampling = dict(model=agent, messages=messages, seed=7, temperature=0.9, max_tokens=12)
out = {}

r = client.chat.completions.create(**sampling, logprobs=True, top_logprobs=2, extra_body={"return_token_ids": True})
choice = r.choices[0]
out["chat"] = {
    "content": choice.message.content,
    "finish_reason": choice.finish_reason,
    "logprobs": [t.logprob for t in choice.logprobs.content],
    "top_counts": [len(t.top_logprobs) for t in choice.logprobs.content],
    # vLLM's extension fields, which the client keeps as extras.
    "token_ids": choice.model_extra["token_ids"],
    "prompt_token_ids": r.model_extra["prompt_token_ids"],
}

content, logprobs, chunks, usage, finish, stream_ids, stream_prompt = "", [], 0, None, None, [], None
stream = client.chat.completions.create(
    **sampling, logprobs=True, stream=True, stream_options={"include_usage": True}, extra_body={"return_token_ids": True}
)
for chunk in stream:
    chunks += 1
    extra = chunk.model_extra or {}
    if "prompt_token_ids" in extra:
        stream_prompt = extra["prompt_token_ids"]
    if chunk.usage is not None:
        usage = chunk.usage.completion_tokens
    for c in chunk.choices:
        content += c.delta.content or ""
        if c.logprobs is not None and c.logprobs.content:
            logprobs += [t.logprob for t in c.logprobs.content]
        finish = c.finish_reason or finish
        stream_ids += (c.model_extra or {}).get("token_ids") or []
out["stream"] = {
    "content": content,
    "logprobs": logprobs,
    "chunks": chunks,
    "completion_tokens": usage,
    "finish_reason": finish,
    "token_ids": stream_ids,
    "prompt_token_ids": stream_prompt,
}

completion = dict(model=agent, prompt="abc", seed=3, temperature=1.0, max_tokens=10, stop=["\n"])
out["completion"] = {"text": client.completions.create(**completion).choices[0].text}
out["completion_stream"] = {"text": "".join(c.choices[0].text for c in client.completions.create(**completion, stream=True) if c.choices)}

try:
    client.chat.completions.create(**sampling, logit_bias={"5": 3})
    out["refused"] = None
except openai.BadRequestError as e:
    body = e.body if isinstance(e.body, dict) else {}
    out["refused"] = {"status": e.status_code, "param": body.get("param", body.get("error", {}).get("param"))}

print(json.dumps(out))
