"""``teacher_traces``: generation from a local model or an OpenAI-compatible endpoint (a fake server on 127.0.0.1),
reward filtering, content-addressed on-disk cache, resume after an interruption, and bad input."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trl_ext.embedded.arithmetic import arithmetic_dataset
from trl_ext.errors import RecipeError
from trl_ext.recipe import StageSpec
from trl_ext.stage import resolve_stage
from trl_ext_plugins.distill.teacher_traces import TeacherTraces, TeacherTracesParams
from trl_ext_plugins.preference import generation as gen


def answer(prompt: str) -> str:
    """The fake teacher: right on prompts whose first operand is even, off by one otherwise."""
    a, b = prompt.rstrip("=").split("+")
    return str(int(a) + int(b) + (int(a) % 2))


@pytest.fixture
def server():
    state = {"requests": [], "fail_on": set()}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state["requests"].append((self.path, body))
            if len(state["requests"]) in state["fail_on"]:
                self.send_response(500)
                self.end_headers()
                return
            choices = [{"index": i * body["n"] + j, "text": answer(p)} for i, p in enumerate(body["prompt"])
                       for j in range(body["n"])]
            payload = json.dumps({"choices": choices}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    state["url"] = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    try:
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()


def traces(params, dataset, split="train"):
    return TeacherTraces(TeacherTracesParams(**params)).trl_ext_prepare_dataset(dataset=dataset, split=split,
                                                                                  stage=None)


def test_endpoint_traces_filtered_by_reward(server, tmp_path):
    prompts = arithmetic_dataset("train", format="prompt", size=12)
    params = dict(teacher="fake-7b", endpoint=server["url"], cache_dir=str(tmp_path), chunk_size=5, batch_size=5,
                  reward="exact_match", num_samples=2)
    out = traces(params, prompts)
    even = [r for r in prompts if int(r["prompt"].split("+")[0]) % 2 == 0]
    assert len(out) == 2 * len(even) and set(out["prompt"]) == {r["prompt"] for r in even}
    assert all(c == a for c, a in zip(out["completion"], out["answer"]))
    assert [path for path, _ in server["requests"]] == ["/v1/completions"] * 3  # chunks of 5, 5, 2 prompts
    assert server["requests"][0][1]["model"] == "fake-7b" and server["requests"][0][1]["temperature"] == 0.0


def test_cache_is_reused_and_content_addressed(server, tmp_path):
    prompts = arithmetic_dataset("train", format="prompt", size=6)
    params = dict(teacher="fake-7b", endpoint=server["url"], cache_dir=str(tmp_path))
    first = traces(params, prompts)
    assert len(server["requests"]) == 1
    again = traces({**params, "reward": "exact_match"}, prompts)  # the filter does not change the cache key
    assert len(server["requests"]) == 1 and len(again) < len(first)
    traces({**params, "teacher": "fake-13b"}, prompts)  # another teacher regenerates
    traces(params, arithmetic_dataset("train", format="prompt", size=7))  # another prompt set regenerates
    traces({**params, "max_new_tokens": 5}, prompts)  # another setting regenerates
    assert len(server["requests"]) == 4


def test_interrupted_generation_resumes_at_the_missing_chunk(server, tmp_path):
    prompts = arithmetic_dataset("train", format="prompt", size=12)
    params = dict(teacher="fake-7b", endpoint=server["url"], cache_dir=str(tmp_path), chunk_size=4, batch_size=4)
    server["fail_on"] = {2}
    with pytest.raises(RuntimeError, match="endpoint .*completions failed"):
        traces(params, prompts)
    assert len(server["requests"]) == 2
    out = traces(params, prompts)
    sent = [body["prompt"] for _, body in server["requests"][2:]]
    assert sent == [list(prompts["prompt"][4:8]), list(prompts["prompt"][8:12])]  # chunk 0 came from disk
    assert list(out["prompt"]) == list(prompts["prompt"])
    assert list(out["completion"]) == [answer(p) for p in prompts["prompt"]]


def test_local_teacher_traces_equal_its_greedy_decodes(tiny_model_dir, tmp_path):
    prompts = arithmetic_dataset("train", format="prompt_completion", size=4)
    out = traces(dict(teacher=tiny_model_dir, cache_dir=str(tmp_path), max_new_tokens=6), prompts)
    model, tokenizer = gen.load_policy(tiny_model_dir)
    expected = [s[0] for s in gen.sample_completions(model, tokenizer, list(prompts["prompt"]), max_new_tokens=6)]
    assert list(out["completion"]) == expected  # the dataset's own completions were replaced
    assert list(out["answer"]) == list(prompts["answer"])
    assert traces(dict(teacher=tiny_model_dir, cache_dir=str(tmp_path), max_new_tokens=6), prompts, "eval") is None


def test_bad_input(tmp_path, tiny_model_dir, trl_ext_catalog):
    with pytest.raises(ValueError, match="endpoint must be an http"):
        TeacherTracesParams(teacher="m", endpoint="127.0.0.1:8000")
    trl_ext_catalog.add_plugin(TeacherTraces)
    stage = StageSpec(trainer="sft", model=tiny_model_dir, dataset={"source": "embedded:arithmetic"},
                      plugins=[{"teacher_traces": {"teacher": str(tmp_path / "missing")}}])
    with pytest.raises(RecipeError, match="plugin .teacher_traces.: params.teacher: teacher .* does not exist"):
        resolve_stage(stage, 0, trl_ext_catalog)


def test_nothing_accepted_is_an_error(server, tmp_path):
    prompts = arithmetic_dataset("train", format="prompt", size=30)
    odd = prompts.filter(lambda r: int(r["prompt"].split("+")[0]) % 2 == 1)  # the fake teacher is wrong on all
    with pytest.raises(ValueError, match=f"accepted none of the {len(odd)} teacher responses"):
        traces(dict(teacher="m", endpoint=server["url"], cache_dir=str(tmp_path), reward="exact_match"), odd)


def test_cached_traces_take_the_other_columns_from_the_current_dataset(server, tmp_path):
    """The key holds the teacher, prompts and settings only: a corrected answer (or a new column) came back from the
    cache as it was, and the reward filter scored the teacher against the old label."""
    from datasets import Dataset

    prompts = ["2+3=", "4+4="]  # the fake teacher answers 5 and 8
    params = dict(teacher="fake-7b", endpoint=server["url"], cache_dir=str(tmp_path), reward="exact_match",
                  num_samples=2)
    first = traces(params, Dataset.from_dict({"prompt": prompts, "answer": ["5", "9"]}))
    assert first["prompt"] == ["2+3="] * 2
    corrected = Dataset.from_dict({"prompt": prompts, "answer": ["7", "8"], "level": [1, 2]})
    again = traces(params, corrected)
    assert len(server["requests"]) == 1  # the cache served the second run
    assert again.to_list() == [{"prompt": "4+4=", "answer": "8", "level": 2, "completion": "8"}] * 2
    with pytest.raises(ValueError, match="the train dataset has no rows"):
        traces(params, corrected.select([]))
