"""A client that streams chat completions back to back from a member's API until a stop file
appears, one JSON line per request: its status, the tokens streamed, how it finished, the 503
answers (Retry-After) it waited out first, and the connections refused it retried a second later
(its member's process restarting: between its old process's exit and its new one's start; at most
REFUSED_TRIES in a row). Run inside a lab namespace:
`python3 streaming_client.py URL KEY_FILE OUT STOP`."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import httpx

REFUSED_TRIES = 60


def one(client: httpx.Client, url: str, key: str, model: str, i: int) -> dict[str, object]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Count from {i} upward."}],
        "max_tokens": 12,
        "temperature": 0,
        "stream": True,
    }
    rec: dict[str, object] = {
        "i": i, "t0": time.time(), "retried_503": 0, "retried_refused": 0, "chunks": 0, "finish": None
    }  # fmt: skip
    while True:
        try:
            with client.stream(
                "POST", url, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120
            ) as r:
                if r.status_code == 503 and r.headers.get("retry-after"):
                    rec["retried_503"] = int(str(rec["retried_503"])) + 1
                    rec["last_503"] = r.read().decode()[:300]
                    time.sleep(min(float(r.headers["retry-after"]), 2.0))
                    continue
                rec["status"] = r.status_code
                if r.status_code != 200:
                    rec["error"] = r.read().decode()[:500]
                    break
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        rec["done"] = rec.get("done") or line == "data: [DONE]"
                        continue
                    chunk = json.loads(line[6:])
                    rec["chunks"] = int(str(rec["chunks"])) + 1
                    for choice in chunk.get("choices", []):
                        if choice.get("finish_reason"):
                            rec["finish"] = choice["finish_reason"]
                break
        except httpx.ConnectError as exc:
            refused = int(str(rec["retried_refused"])) + 1
            if refused > REFUSED_TRIES:
                rec["error"] = f"ConnectError {refused - 1} times in a row: {exc}"
                break
            rec["retried_refused"] = refused
            time.sleep(1.0)
        except httpx.HTTPError as exc:
            rec["error"] = f"{type(exc).__name__}: {exc}"
            break
    rec["t1"] = time.time()
    return rec


def main() -> None:
    url, key_file, out, stop = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
    key = key_file.read_text().strip()
    i = 0
    with httpx.Client() as client, out.open("a") as f:
        models = client.get(
            url.replace("/chat/completions", "/models"), headers={"Authorization": f"Bearer {key}"}
        )
        model = models.json()["data"][0]["id"]
        while not stop.exists():
            f.write(json.dumps(one(client, url, key, model, i)) + "\n")
            f.flush()
            i += 1


if __name__ == "__main__":
    main()
