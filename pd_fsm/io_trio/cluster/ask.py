"""`pd-fsm cluster --ask PROMPT`: one chat prompt through the proxy and to the colocated worker,
both answers printed side by side.

Its own module because both runners ask it (``local`` and ``ray_driver``), and ``local`` starts
``ray_driver``: kept in either, it would close an import circle.
"""

from __future__ import annotations

import json
import sys

from pd_fsm.io_trio.http_server import http_client
from pd_fsm.io_trio.tls import NO_TLS, TLS


async def ask(urls: dict[str, str], prompt: str, max_tokens: int, headers: dict[str, str],
              tls: TLS = NO_TLS) -> int:
    """Send one chat prompt through the proxy and to the colocated worker (``urls`` by service
    name); print both answers."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0}
    answers: dict[str, str] = {}
    status = 0
    async with http_client(timeout=300, tls=tls) as http:
        http.headers.update(headers)
        for name in ("proxy", "colocated"):
            if name not in urls:
                continue
            r = await http.post(f"{urls[name]}/v1/chat/completions", json=body)
            if r.status_code == 200:
                answers[name] = r.json()["choices"][0]["message"]["content"]
            else:
                answers[name] = f"ERROR HTTP {r.status_code}: {r.text[:500]}"
                status = 1
    print(f"\nQ: {prompt}", flush=True)
    pd = answers.get("proxy", "(no prefill/decode workers in this cluster)")
    print(f"PD (proxy -> prefill + decode): {json.dumps(pd)}")
    if "colocated" in answers:
        print(f"colocated:                      {json.dumps(answers['colocated'])}")
    if "proxy" in answers and "colocated" in answers:
        same = answers["proxy"] == answers["colocated"]
        print(f"identical: {same}")
    sys.stdout.flush()
    return status
