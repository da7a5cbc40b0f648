"""Checkpoint ranges from an HTTP(S) mirror or the Hugging Face hub (`--weights-from URL`).

A mirror is any server where `<URL>/<file>` answers the checkpoint's files (config.json,
model.safetensors or its shards, tokenizer.json, ...) and honours `Range` requests (206). A hub
model page URL (`https://huggingface.co/<org>/<repo>`) means its `resolve/main` URLs; a URL that
already names `/resolve/<revision>` is used as is. A token in the environment's HF_TOKEN goes with
every request to the hub, and to another mirror only once it answered 401 or 403.

The bytes are checked like any source's (kafila.session.weights.fetch: each tensor's sha256 from
the host's manifest); a mirror holding another checkpoint is skipped before any tensor is asked for:
its first safetensors header must say the same length as the host's.
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
from pathlib import Path
from urllib.parse import quote, urlsplit

import httpx

from kafila.models.checkpoint import INDEX_FILE
from kafila.obs.log import get_logger
from kafila.session.weights.manifest import SMALL_FILES, WeightManifest, WeightsError
from kafila.session.weights.sources import Job, Sink

log = get_logger("kafila.session.weights")

HUB_HOSTS = ("huggingface.co", "hf.co")
TOKEN_ENV = "HF_TOKEN"
MIRROR_REQUEST = 8 << 20  # bytes per ranged GET
MIRROR_WINDOW = 4  # ranged GETs in flight


def mirror_base(url: str) -> str:
    """The folder URL whose `/<file>` is each checkpoint file (a hub model page -> its resolve/main)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--weights-from {url!r}: not an http:// or https:// URL")
    base = url.rstrip("/")
    if (parts.hostname or "") in HUB_HOSTS and "/resolve/" not in parts.path:
        base += "/resolve/main"
    return base


def is_hub(url: str) -> bool:
    return (urlsplit(url).hostname or "") in HUB_HOSTS


class MirrorReader:
    """Ranges by HTTP GET with `Range: bytes=a-b` (206 with exactly the bytes asked, or a failure)."""

    kind = "mirror"

    def __init__(
        self,
        url: str,
        token: str | None = None,
        window: int = MIRROR_WINDOW,
        timeout: float = 30.0,
        max_request: int = MIRROR_REQUEST,
    ) -> None:
        self.base = mirror_base(url)
        self.name = f"mirror {self.base}"
        self.token = token if token is not None else os.environ.get(TOKEN_ENV) or None
        self.window, self.timeout, self.max_request = window, timeout, max_request
        self._authorize = is_hub(self.base) and self.token is not None
        self._files: set[str] = set()

    def url(self, file: str) -> str:
        return f"{self.base}/{quote(file)}"

    def _headers(self, a: int | None = None, b: int | None = None) -> dict[str, str]:
        headers = {"Accept-Encoding": "identity"}
        if a is not None and b is not None:
            headers["Range"] = f"bytes={a}-{b - 1}"
        if self._authorize and self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    async def download(self, client: httpx.AsyncClient, file: str, to: Path, required: bool = True) -> bool:
        """The whole of `file` into `to` (a temporary name, then renamed); False when the mirror has
        no such file and it is not `required`."""
        async with client.stream("GET", self.url(file), headers=self._headers()) as r:
            if r.status_code in (401, 403) and self.token and not self._authorize:
                self._authorize = True
                return await self.download(client, file, to, required)
            if r.status_code == 404 and not required:
                return False
            if r.status_code != 200:
                raise WeightsError(f"{self.name}: {file}: HTTP {r.status_code}, not 200")
            expected = r.headers.get("Content-Length")
            tmp = to.with_name(f".{to.name}.part")
            n = 0
            with open(tmp, "wb") as f:
                async for chunk in r.aiter_bytes(1 << 20):
                    f.write(chunk)
                    n += len(chunk)
        if expected is not None and n != int(expected):
            tmp.unlink(missing_ok=True)
            raise WeightsError(f"{self.name}: {file}: {n} bytes of {expected}: the download was cut short")
        os.replace(tmp, to)
        return True

    async def get(self, client: httpx.AsyncClient, file: str, a: int, b: int) -> bytes:
        """Bytes [a, b) of `file`; WeightsError when the mirror does not answer exactly them."""
        try:
            r = await client.get(self.url(file), headers=self._headers(a, b))
            if r.status_code in (401, 403) and self.token and not self._authorize:
                self._authorize = True  # it wants the token: from now on it gets it
                r = await client.get(self.url(file), headers=self._headers(a, b))
        except httpx.HTTPError as exc:
            raise WeightsError(f"{self.name}: {file} bytes [{a}, {b}): {type(exc).__name__}: {exc}") from exc
        if r.status_code != 206 or len(r.content) != b - a:
            hint = " (set HF_TOKEN)" if r.status_code in (401, 403) and not self.token else ""
            raise WeightsError(
                f"{self.name}: {file} bytes [{a}, {b}): HTTP {r.status_code} with {len(r.content)} "
                f"bytes, not 206 with {b - a}{hint}"
            )
        return r.content

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(follow_redirects=True, timeout=self.timeout)

    async def prepare(self, m: WeightManifest) -> bool:
        """The mirror serves this checkpoint: its first safetensors file's header length matches."""
        first = sorted(m.headers)[0]
        async with self.client() as client:
            head = await self.get(client, first, 0, 8)
        (n,) = struct.unpack("<Q", head)
        if n + 8 != m.headers[first]:
            log.warning(
                "weights_mirror_differs", source=self.name, file=first, header=n + 8, host=m.headers[first]
            )
            return False
        self._files = set(m.headers) | set(m.files)
        return True

    def offers(self, file: str, start: int, end: int) -> bool:
        return file in self._files

    async def run(self, jobs: list[Job], sink: Sink) -> None:
        """Every job with up to `window` GETs in flight, each answer handed to `sink` as it comes."""
        queue = list(reversed(jobs))
        async with self.client() as client:

            async def worker() -> None:
                while queue:
                    job = queue.pop()
                    data = await self.get(client, job.file, job.offset, job.offset + job.length)
                    await sink(job, data)

            try:
                async with asyncio.TaskGroup() as tg:
                    for _ in range(min(self.window, len(jobs))):
                        tg.create_task(worker())
            except ExceptionGroup as group:  # the first failure, as every other source raises it
                raise group.exceptions[0] from None


DOWNLOADED = ".kafila-downloaded"  # in a folder fetch_checkpoint finished: the mirror's URL


async def fetch_checkpoint(url: str, folder: Path, timeout: float = 60.0) -> Path:
    """The checkpoint at mirror `url` (config.json, the safetensors files its index names or
    model.safetensors, the small files it has) into `folder`, for a host that starts from a mirror;
    a folder finished before from the same URL is used as it is."""
    done = folder / DOWNLOADED
    base = mirror_base(url)
    if done.is_file() and done.read_text().strip() == base:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    reader = MirrorReader(url, timeout=timeout)
    async with reader.client() as client:
        await reader.download(client, "config.json", folder / "config.json")
        index = folder / INDEX_FILE
        if await reader.download(client, INDEX_FILE, index, required=False):
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = ["model.safetensors"]
        for name in files:
            if Path(name).name != name:
                raise WeightsError(f"{reader.name}: its index names {name!r}, not a file in the folder")
            log.info("weights_mirror_download", source=reader.name, file=name)
            await reader.download(client, name, folder / name)
        for name in SMALL_FILES:
            if name != "config.json":
                await reader.download(client, name, folder / name, required=False)
    done.write_text(base)
    return folder


def needs_fetching(model: str) -> bool:
    """Whether a host's --model names no model this machine has: not a default model, not a
    folder, a plain name (a host with --weights-from fetches it into the cache's models folder)."""
    from kafila.models.default import DEFAULT_MODELS

    if model in DEFAULT_MODELS or "/" in model or os.sep in model:
        return False
    return not Path(model).expanduser().is_dir()


async def mirror_lacks(url: str, timeout: float = 15.0) -> list[str]:
    """The checkpoint files the mirror at `url` does not answer: config.json, and the safetensors
    files its model.safetensors.index.json names, or model.safetensors (empty: it has them all)."""
    lacking = await missing_files(url, ["config.json", INDEX_FILE], timeout)
    if INDEX_FILE in lacking:
        return [n for n in lacking if n != INDEX_FILE] + await missing_files(
            url, ["model.safetensors"], timeout
        )
    reader = MirrorReader(url, timeout=timeout)
    async with reader.client() as client:
        r = await client.get(reader.url(INDEX_FILE), headers=reader._headers())
    try:
        files = sorted(set(json.loads(r.content)["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError):
        return [*lacking, f"{INDEX_FILE} (not an index: no weight_map)"]
    return lacking + await missing_files(url, files, timeout)


async def missing_files(url: str, names: list[str], timeout: float = 15.0) -> list[str]:
    """Which of `names` the mirror at `url` does not answer (a one-byte ranged GET of each)."""
    reader = MirrorReader(url, timeout=timeout)
    missing = []
    async with reader.client() as client:
        for name in names:
            try:
                await reader.get(client, name, 0, 1)
            except WeightsError as exc:
                log.info("weights_mirror_lacks", source=reader.name, file=name, error=str(exc))
                missing.append(name)
    return missing
