#!/usr/bin/env python3
"""Latency and throughput of MaPoRL's `POST /predict` on a running reward server (started with
`--verifier-endpoint` pointing at a rollout worker that serves a verifier), called the way MaPoRL's
trainer calls it: a JSON body of [user, assistant] message pairs posted by a plain HTTP client.

    python3 scripts/bench/predict_bench.py --url http://127.0.0.1:8000/predict \
        [--requests 64] [--concurrency 1,4,16] [--batch 4] [--answer-words 120]

Prints the CPU model, then per concurrency level: requests/s, conversations/s and the p50/p95/max
latency of one call. Standard library only.
"""

import argparse
import json
import subprocess
import threading
import time
import urllib.request


def cpu():
    out = subprocess.run(["lscpu"], capture_output=True, text=True, env={"LC_ALL": "C"}).stdout
    field = lambda k: next((l.split(":", 1)[1].strip() for l in out.splitlines() if l.startswith(k + ":")), "?")
    return f"{field('Model name')} (family {field('CPU family')}, model {field('Model')})"


def body(batch, words, seed):
    convs = []
    for i in range(batch):
        q = f"Natalia sold clips to {40 + seed + i} of her friends in April, and then she sold half as many clips in May. How many clips did she sell altogether?"
        a = " ".join(["so"] * words) + f" \\boxed{{{seed + i}}}"
        convs.append([{"role": "user", "content": "Question: " + q}, {"role": "assistant", "content": a}])
    return json.dumps({"query_responses": convs}).encode()


def call(url, data):
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    return time.perf_counter() - t, out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="http://127.0.0.1:8000/predict")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--batch", type=int, default=4, help="conversations per request")
    p.add_argument("--answer-words", type=int, default=120)
    a = p.parse_args()
    print(f"CPU: {cpu()}")
    print(f"{a.requests} requests of {a.batch} conversations (answers of about {a.answer_words} words) to {a.url}")
    lat, out = call(a.url, body(a.batch, a.answer_words, 0))  # warm-up
    assert len(out["result"]) == a.batch, out
    print(f"{'concurrency':>11} {'req/s':>8} {'conv/s':>8} {'p50 s':>8} {'p95 s':>8} {'max s':>8}")
    for c in [int(x) for x in a.concurrency.split(",")]:
        lats, lock, next_i = [], threading.Lock(), [0]

        def worker():
            while True:
                with lock:
                    i = next_i[0]
                    next_i[0] += 1
                if i >= a.requests:
                    return
                l, r = call(a.url, body(a.batch, a.answer_words, i))
                assert len(r["result"]) == a.batch and all(0.0 <= s <= 1.0 for s in r["result"]), r
                with lock:
                    lats.append(l)

        t = time.perf_counter()
        threads = [threading.Thread(target=worker) for _ in range(c)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wall = time.perf_counter() - t
        lats.sort()
        q = lambda f: lats[min(len(lats) - 1, int(f * len(lats)))]
        print(f"{c:>11} {a.requests / wall:>8.2f} {a.requests * a.batch / wall:>8.2f} {q(0.5):>8.3f} {q(0.95):>8.3f} {lats[-1]:>8.3f}")


if __name__ == "__main__":
    main()
