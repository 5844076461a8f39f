"""llama.cpp's `llama-server` as a peer for `python -m bench.peer`: built
from the llama-cpp-python source distribution on PyPI (its
vendor/llama.cpp is llama.cpp at a known commit), fed a GGUF converted
from the same checkpoint with the converter shipped in that sdist, and
driven over its native `/completion` API.

Everything built or converted is cached under
`<cache>/<version>/` (`--cache-dir`, `LLMSCHED_LLAMA_CPP_CACHE`, default
`~/.cache/llmsched/llama-cpp`), so only the first run pays the build
(about 11 minutes on 2 cores).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from llmsched.launch import stop_process, wait_http_ok
from llmsched.server import free_port

# The pinned llama-cpp-python release whose vendor/llama.cpp we build.
SDIST_VERSION = "0.3.36"
CACHE_ENV = "LLMSCHED_LLAMA_CPP_CACHE"
SERVER_TARGET = "llama-server"


def cache_root(override: Path | None = None) -> Path:
    if override is not None:
        return override
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path.home() / ".cache" / "llmsched" / "llama-cpp"


# The instruction sets llama-server may be built for: `native` (its default,
# -march=native) or `avx2` (GGML_NATIVE off: AVX, AVX2, FMA, F16C and BMI2,
# no AVX-512), which stands in for an AVX2 machine on an AVX-512 one.
ISA_FLAGS = {"native": [], "avx2": ["-DGGML_NATIVE=OFF"]}


@dataclass(slots=True)
class Paths:
    """Where one pinned version lives in the cache."""

    version: str
    root: Path  # <cache>/<version>
    isa: str = "native"  # a key of ISA_FLAGS: each has a build directory of its own

    @classmethod
    def make(cls, version: str = SDIST_VERSION, cache: Path | None = None, isa: str = "native") -> Paths:
        if isa not in ISA_FLAGS:
            raise ValueError(f"isa {isa!r}: not one of {sorted(ISA_FLAGS)}")
        return cls(version, cache_root(cache) / version, isa)

    @property
    def source(self) -> Path:  # the unpacked sdist
        return self.root / f"llama_cpp_python-{self.version}"

    @property
    def llama_cpp(self) -> Path:
        return self.source / "vendor" / "llama.cpp"

    @property
    def build(self) -> Path:
        return self.root / ("build" if self.isa == "native" else f"build-{self.isa}")

    @property
    def server(self) -> Path:
        return self.build / "bin" / SERVER_TARGET

    @property
    def gguf_dir(self) -> Path:
        return self.root / "gguf"


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sdist_name(version: str) -> str:
    return f"llama_cpp_python-{version}.tar.gz"


def fetch_sdist(paths: Paths, sdist: Path | None = None) -> Path:
    """The sdist tarball: `sdist` when given, else the cached one, else
    `pip download` of the pinned version (no wheels, no dependencies)."""
    if sdist is not None:
        if sdist.name != sdist_name(paths.version):
            raise SystemExit(f"--sdist {sdist}: expected {sdist_name(paths.version)} (the pinned version)")
        return sdist
    cached = paths.root / sdist_name(paths.version)
    if cached.exists():
        return cached
    paths.root.mkdir(parents=True, exist_ok=True)
    _say(f"downloading llama-cpp-python=={paths.version} (sdist) from PyPI")
    subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={paths.version}", "--no-deps",
                    "--no-binary", ":all:", "-d", str(paths.root)], check=True)
    return cached


def unpack(paths: Paths, sdist: Path | None = None) -> Path:
    """vendor/llama.cpp of the unpacked sdist."""
    if not (paths.llama_cpp / "CMakeLists.txt").exists():
        tarball = fetch_sdist(paths, sdist)
        paths.root.mkdir(parents=True, exist_ok=True)
        with tarfile.open(tarball) as tar:
            tar.extractall(paths.root, filter="data")
    return paths.llama_cpp


def configure_args(source: Path, build: Path, isa: str = "native") -> list[str]:
    """cmake's configure command: Release, CPU only, a static llama-server
    with nothing downloaded at build time (no CURL, no prebuilt web UI),
    for the instruction sets `isa` names (ISA_FLAGS)."""
    return ["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
            "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF", "-DGGML_VULKAN=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
            "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF", *ISA_FLAGS[isa]]


def build_args(build: Path, jobs: int) -> list[str]:
    return ["cmake", "--build", str(build), "--target", SERVER_TARGET, "-j", str(jobs)]


def build_server(paths: Paths, sdist: Path | None = None, jobs: int | None = None, nice: int = 10) -> Path:
    """The llama-server binary, built once per version (the build directory
    is the cache: a finished build is reused as it is)."""
    if paths.server.exists():
        return paths.server
    source = unpack(paths, sdist)
    jobs = jobs or os.cpu_count() or 1
    log = paths.build.with_suffix(".log")
    _say(f"building {SERVER_TARGET} ({paths.isa}) from llama-cpp-python {paths.version} with {jobs} jobs under "
         f"nice {nice} (about 11 minutes on 2 cores); log: {log}")
    started = time.monotonic()
    prefix = ["nice", "-n", str(nice)] if nice else []
    with log.open("a") as out:
        for cmd in (configure_args(source, paths.build, paths.isa), build_args(paths.build, jobs)):
            out.write("$ " + " ".join(cmd) + "\n")
            out.flush()
            if subprocess.run(prefix + cmd, stdout=out, stderr=subprocess.STDOUT).returncode:
                raise SystemExit(f"building {SERVER_TARGET} failed: see {log}")
    _say(f"built {paths.server} in {time.monotonic() - started:.0f} s")
    return paths.server


def checkpoint_key(model_dir: Path, outtype: str) -> str:
    """A file name for the GGUF of `model_dir`: its name, a digest of its
    path and its files' sizes and mtimes (a rewritten checkpoint converts
    again), and the output type."""
    h = hashlib.sha1(str(model_dir.resolve()).encode())
    for f in sorted(model_dir.iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return f"{model_dir.name}-{h.hexdigest()[:12]}-{outtype}.gguf"


def convert(paths: Paths, model_dir: Path, outtype: str = "f32", sdist: Path | None = None) -> Path:
    """The checkpoint as GGUF, converted by the sdist's convert_hf_to_gguf.py
    with its vendored gguf-py on PYTHONPATH (it also needs numpy, and
    sentencepiece for a tokenizer.model: the `bench` extra)."""
    out = paths.gguf_dir / checkpoint_key(model_dir, outtype)
    if out.exists():
        return out
    source = unpack(paths, sdist)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(source / "gguf-py"),
                                                                     os.environ.get("PYTHONPATH")]))}
    tmp = out.with_suffix(".tmp")
    cmd = [sys.executable, str(source / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", outtype,
           "--outfile", str(tmp)]
    _say(f"converting {model_dir} to GGUF {outtype}")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"convert_hf_to_gguf.py failed:\n{done.stderr[-3000:]}")
    tmp.rename(out)
    return out


# ----- the server -------------------------------------------------------------


def server_args(binary: Path, gguf: Path, port: int, threads: int, parallel: int, context: int) -> list[str]:
    """One slot per stream, `context` tokens per slot (llama-server splits
    -c among the slots), the same threads for decode and prefill."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-tb", str(threads), "-np", str(parallel), "-c", str(context * parallel)]


@dataclass(slots=True)
class LlamaServer:
    args: list[str]
    port: int
    proc: subprocess.Popen | None = None
    log: object = None

    @classmethod
    def make(cls, binary: Path, gguf: Path, threads: int, parallel: int, context: int) -> LlamaServer:
        port = free_port()
        return cls(server_args(binary, gguf, port, threads, parallel, context), port)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self, timeout_s: float = 120.0) -> LlamaServer:
        self.proc = subprocess.Popen(self.args, stdout=self.log or subprocess.DEVNULL, stderr=subprocess.STDOUT)
        try:
            wait_http_ok(f"{self.url}/health", timeout_s, self.proc)  # 200 once the model is loaded
        except (RuntimeError, TimeoutError) as exc:
            self.stop()
            raise type(exc)(f"llama-server: {exc}: {' '.join(self.args)}") from None
        return self

    def stop(self, timeout_s: float = 15.0) -> None:
        stop_process(self.proc, timeout_s)


# ----- /completion ------------------------------------------------------------


def completion_body(prompt_ids: list[int], n_predict: int, stream: bool = False) -> dict:
    """Greedy (top-k 1 is the only sampler), exactly n_predict tokens
    (ignore_eos), no prompt cache (each prompt is computed, as ours are),
    and the token ids back for the greedy comparison."""
    return {"prompt": list(prompt_ids), "n_predict": n_predict, "ignore_eos": True, "temperature": 0.0,
            "top_k": 1, "samplers": ["top_k"], "cache_prompt": False, "return_tokens": True, "stream": stream}


@dataclass(slots=True)
class Completion:
    tokens: list[int]
    timings: dict
    chunk_times: list[float] = field(default_factory=list)  # perf_counter of each chunk that carried tokens
    end: float = 0.0

    @property
    def predicted_per_token_ms(self) -> float:
        return float(self.timings["predicted_per_token_ms"])

    def client_ms_per_token(self) -> float:
        """First token's arrival to the last's, over the tokens in between:
        the prefill left out, as bench.single_stream times ours."""
        if len(self.tokens) < 2 or len(self.chunk_times) < 2:
            return float("nan")
        return (self.chunk_times[-1] - self.chunk_times[0]) * 1000 / (len(self.tokens) - 1)


def parse_completion(body: dict) -> Completion:
    """A non-streamed /completion answer."""
    if "error" in body:
        raise RuntimeError(f"llama-server: {body['error']}")
    return Completion(list(body.get("tokens") or []), dict(body.get("timings") or {}))


def parse_stream_line(line: bytes) -> dict | None:
    """One server-sent-events line of a streamed /completion: its JSON, or
    None for blank lines and anything that is not `data: ...`."""
    line = line.strip()
    if not line.startswith(b"data:"):
        return None
    payload = line[5:].strip()
    if payload == b"[DONE]":
        return None
    return json.loads(payload)


def _post(url: str, body: dict, timeout_s: float):
    req = urllib.request.Request(f"{url}/completion", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout_s)


def complete(url: str, prompt_ids: list[int], n_predict: int, timeout_s: float = 600.0) -> Completion:
    with _post(url, completion_body(prompt_ids, n_predict), timeout_s) as resp:
        done = parse_completion(json.loads(resp.read()))
    done.end = time.perf_counter()
    return done


def complete_streamed(url: str, prompt_ids: list[int], n_predict: int, timeout_s: float = 600.0) -> Completion:
    """Streamed, each chunk timed on arrival; the last chunk carries the
    timings."""
    out = Completion([], {})
    with _post(url, completion_body(prompt_ids, n_predict, stream=True), timeout_s) as resp:
        for line in resp:
            event = parse_stream_line(line)
            if event is None:
                continue
            if "error" in event:
                raise RuntimeError(f"llama-server: {event['error']}")
            if event.get("tokens"):
                out.chunk_times.append(time.perf_counter())
                out.tokens.extend(event["tokens"])
            if event.get("timings"):
                out.timings = event["timings"]
    out.end = time.perf_counter()
    return out
