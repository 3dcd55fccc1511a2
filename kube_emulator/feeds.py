"""The endpoints that stream: watches (a store watcher's events, as chunked JSON lines) and
followed logs (a pod's node log, read as it grows)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from aiohttp import web

from kube_emulator.api import ApiError
from kube_emulator.cluster import Cluster
from kube_emulator.store import Expired, Watcher
from kube_emulator.streams import container_name, query_flag


async def watch(
    request: web.Request, cluster: Cluster, resource: str, namespace: str | None, labels: Any, fields: Any
) -> web.StreamResponse:
    store = cluster.store
    watcher = Watcher(resource, namespace, labels, fields)
    timeout_s = request.query.get("timeoutSeconds")
    version = request.query.get("resourceVersion")
    expire = cluster.faults.take_expired_watch() if version not in (None, "", "0") else None
    if expire == "status":
        raise ApiError(410, "Expired", f"too old resource version: {version} (injected by the kube emulator)")
    try:
        initial = store.watch(watcher, version)
        if expire == "event":
            raise Expired(f"too old resource version: {version} (injected by the kube emulator)")
    except Expired as exc:
        initial = None
        expired = str(exc)
    except ValueError as exc:
        raise ApiError(400, "BadRequest", str(exc)) from None
    response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
    response.enable_chunked_encoding()
    await response.prepare(request)
    try:
        if initial is None:
            status = ApiError(410, "Expired", expired).status()
            await response.write(json.dumps({"type": "ERROR", "object": status}).encode() + b"\n")
            return response
        for type_, obj in initial:
            await response.write(json.dumps({"type": type_, "object": obj}, separators=(",", ":")).encode() + b"\n")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + float(timeout_s) if timeout_s else None
        while True:
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                break
            try:
                item = await asyncio.wait_for(watcher.queue.get(), remaining)
            except asyncio.TimeoutError:
                break
            if item is None:
                break
            type_, obj = item
            await response.write(json.dumps({"type": type_, "object": obj}, separators=(",", ":")).encode() + b"\n")
        with contextlib.suppress(ConnectionError):
            await response.write_eof()
    except ConnectionError:
        pass
    finally:
        store.unwatch(watcher)
    return response


async def log(request: web.Request, cluster: Cluster, namespace: str, name: str) -> web.StreamResponse:
    pod = cluster.get("pods", namespace, name)
    cname = container_name(pod, request.query.get("container"))
    previous = query_flag(request.query.get("previous"))
    uid = pod["metadata"]["uid"]
    path = cluster.kubelet.log_file(namespace, name, uid, previous)
    if not path.exists():
        if previous:
            raise ApiError(400, "BadRequest", f'previous terminated container "{cname}" in pod "{name}" not found')
        statuses = (pod.get("status") or {}).get("containerStatuses") or [{}]
        reason = ((statuses[0].get("state") or {}).get("waiting") or {}).get("reason") or "ContainerCreating"
        raise ApiError(400, "BadRequest", f'container "{cname}" in pod "{name}" is waiting to start: {reason}')
    data = path.read_bytes()
    tail = request.query.get("tailLines")
    if tail is not None:
        lines = data.splitlines(keepends=True)
        data = b"".join(lines[-int(tail) :]) if int(tail) > 0 else b""
    limit = request.query.get("limitBytes")
    if limit is not None:
        data = data[: int(limit)]
    if not query_flag(request.query.get("follow")) or previous:
        return web.Response(body=data, content_type="text/plain")
    response = web.StreamResponse(status=200, headers={"Content-Type": "text/plain"})
    response.enable_chunked_encoding()
    await response.prepare(request)
    offset = path.stat().st_size
    inode = path.stat().st_ino
    try:
        if data:
            await response.write(data)
        while True:
            rt = cluster.kubelet.runtimes.get(uid)
            alive = rt is not None and rt.node is not None
            try:
                st = path.stat()
            except OSError:
                break
            if st.st_ino != inode:
                break  # the container restarted: a real follow ends with the old container
            if st.st_size > offset:
                with open(path, "rb") as fh:
                    fh.seek(offset)
                    chunk = fh.read(st.st_size - offset)
                offset += len(chunk)
                await response.write(chunk)
                continue
            if not alive:
                break
            await asyncio.sleep(0.1)
        await response.write_eof()
    except ConnectionError:
        pass
    return response
