"""`ferrite-engine serve --from-manifest` serves an LLMService's model with the flags the
operator would give the pod; what the engine cannot do yet is refused, not ignored."""
import json
import subprocess
import time
import urllib.request

from conftest import BIN, MODEL, free_port

MANIFEST = """apiVersion: serving.ferrite.dev/v1alpha1
kind: LLMService
metadata: {{name: smollm2-local}}
spec:
  model:
    source: {source}
  engine:
    maxModelLen: 1024
    maxNumSeqs: 8
    enablePrefixCaching: false
"""


def test_manifest_model_name_and_engine_settings_are_served(tmp_path):
    manifest = tmp_path / "llms.yaml"
    manifest.write_text(MANIFEST.format(source="file://" + MODEL))
    port = free_port()
    proc = subprocess.Popen([BIN, "serve", "--from-manifest", str(manifest), "--host", "127.0.0.1", "--port", str(port),
                             "--kv-cache-memory", "100000000"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1) as r:
                    models = json.load(r)
                    break
            except OSError:
                assert proc.poll() is None, proc.stderr.read().decode()
                assert time.time() < deadline
                time.sleep(0.2)
        assert models["data"][0]["id"] == "smollm2-local"
        assert models["data"][0]["max_model_len"] == 1024
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_hf_sources_are_refused_locally_with_what_to_do(tmp_path):
    manifest = tmp_path / "llms.yaml"
    manifest.write_text(MANIFEST.format(source="hf://HuggingFaceTB/SmolLM2-135M-Instruct"))
    r = subprocess.run([BIN, "serve", "--from-manifest", str(manifest)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "file:///abs/path" in r.stderr and "hf://HuggingFaceTB/SmolLM2-135M-Instruct" in r.stderr


def test_a_gpu_device_is_refused_at_startup_saying_the_engine_computes_on_cpu():
    r = subprocess.run([BIN, "serve", "--model", MODEL, "--device", "cuda", "--port", str(free_port())],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "--device cuda" in r.stderr and "computes on CPU only" in r.stderr
    assert "spec.gpuResource" in r.stderr
