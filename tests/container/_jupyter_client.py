"""A Jupyter client that runs inside the image (tornado comes with JupyterLab): it talks to a
Jupyter server as the browser does, over the REST API and its WebSockets, and prints one JSON
object with what it saw.

    python _jupyter_client.py http://HOST:8888 TOKEN

- ``status``: HTTP status of ``GET /api/kernels`` without a token, with a wrong one, with it;
- ``cell``: a kernel (``POST /api/kernels``) runs :data:`CELL`, which imports cudampi and does a
  1-rank Communicator allreduce; its reply status and output;
- ``terminal``: a terminal (``POST /api/terminals``) runs ``cudampi doctor``; its output and
  the exit status the shell echoed.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import urllib.error
import urllib.request
import uuid
from typing import Any

CELL = """
import numpy as np
from mpi4py import MPI
import cudampi
comm = cudampi.Communicator(MPI.COMM_WORLD)
y = comm.allreduce(np.arange(4.0))
print("cell:", "cudampi", cudampi.__version__, "ranks", comm.size, "allreduce", y.tolist())
"""

TIMEOUT = 180.0


def http(url: str, token: str | None, method: str = "GET", body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, method=method, data=data)
    if token is not None:
        req.add_header("Authorization", f"token {token}")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw = r.read()
            return r.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as e:
        return e.code, None


async def connect(url: str, token: str) -> Any:
    from tornado.httpclient import HTTPRequest
    from tornado.websocket import websocket_connect

    ws = url.replace("http", "ws", 1)
    return await websocket_connect(HTTPRequest(ws, headers={"Authorization": f"token {token}"}))


async def run_cell(base: str, token: str, code: str) -> dict[str, Any]:
    status, kernel = http(f"{base}/api/kernels", token, "POST", {"name": "python3"})
    if status != 201:
        return {"error": f"POST /api/kernels: HTTP {status}"}
    conn = await connect(f"{base}/api/kernels/{kernel['id']}/channels", token)
    msg_id = uuid.uuid4().hex
    header = {
        "msg_id": msg_id,
        "username": "test",
        "session": uuid.uuid4().hex,
        "msg_type": "execute_request",
        "version": "5.3",
    }
    content = {
        "code": code,
        "silent": False,
        "store_history": False,
        "user_expressions": {},
        "allow_stdin": False,
        "stop_on_error": True,
    }
    request = {"header": header, "parent_header": {}, "metadata": {}, "content": content}
    conn.write_message(json.dumps({**request, "channel": "shell", "buffers": []}))
    out: list[str] = []
    reply, idle = None, False
    while reply is None or not idle:
        raw = await asyncio.wait_for(conn.read_message(), TIMEOUT)
        if raw is None:
            out.append("<the kernel's websocket closed>")
            break
        msg = json.loads(raw)
        if msg.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        kind = msg["msg_type"]
        if kind == "stream":
            out.append(msg["content"]["text"])
        elif kind == "error":
            out.append("\n".join(msg["content"]["traceback"]))
        elif kind == "execute_reply":
            reply = msg["content"]["status"]
        elif kind == "status" and msg["content"]["execution_state"] == "idle":
            idle = True
    conn.close()
    http(f"{base}/api/kernels/{kernel['id']}", token, "DELETE")
    return {"status": reply, "output": "".join(out)}


async def run_in_terminal(base: str, token: str, command: str) -> dict[str, Any]:
    status, term = http(f"{base}/api/terminals", token, "POST")
    if status != 200:
        return {"error": f"POST /api/terminals: HTTP {status}"}
    conn = await connect(f"{base}/terminals/websocket/{term['name']}", token)
    # The shell echoes the line as typed ($?); only the shell's own expansion has digits.
    conn.write_message(json.dumps(["stdin", f'{command}; echo "exit-status=$?"\r']))
    text, found = "", None
    while found is None:
        raw = await asyncio.wait_for(conn.read_message(), TIMEOUT)
        if raw is None:
            break
        kind, *payload = json.loads(raw)
        if kind == "stdout":
            text += payload[0]
            found = re.search(r"exit-status=(\d+)", text)
    conn.close()
    http(f"{base}/api/terminals/{term['name']}", token, "DELETE")
    return {"output": text, "exit": int(found.group(1)) if found else None}


def wait_ready(base: str) -> float:
    """Seconds until the server answers HTTP at all (any status)."""
    import time

    start = time.monotonic()
    while True:
        try:
            http(f"{base}/api/status", None)
            return time.monotonic() - start
        except OSError:
            if time.monotonic() - start > TIMEOUT:
                raise
            time.sleep(0.2)


async def main(base: str, token: str) -> dict[str, Any]:
    return {
        "ready after": wait_ready(base),
        "status": {
            "no token": http(f"{base}/api/kernels", None)[0],
            "wrong token": http(f"{base}/api/kernels", token + "x")[0],
            "token": http(f"{base}/api/kernels", token)[0],
        },
        "cell": await run_cell(base, token, CELL),
        "terminal": await run_in_terminal(base, token, "cudampi doctor"),
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2]))))
