"""Teachers served by vLLM (``vllm:<url>``) for ``opd_reward`` and ``multi_teacher_opd``.

No vLLM runs here (no GPU): a stand-in HTTP server answers the three routes a served teacher uses, in vLLM's
response shapes (``/v1/models``, ``/tokenize``, and ``/v1/completions`` with ``prompt_logprobs``: position 0 is
``null``, then per position a dict keyed by token id string holding the actual token and the top ``k``, each with
``logprob``, ``rank`` and ``decoded_token``), scoring with a real tiny model over its full vocabulary. The parsed
values are checked against TRL's own parser of that response (``VLLMClient._format_sequence_logprobs``) and the
advantages against the same teacher loaded locally.
"""

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from trl_ext.embedded.models import materialize_model
from trl_ext.errors import RecipeError
from trl_ext.recipe import Recipe, StageSpec, validate_recipe
from trl_ext.stage import resolve_stage
from trl_ext_plugins.distill import teachers as tch
from trl_ext_plugins.distill.opd import MultiTeacherOPD, MultiTeacherParams, OPDReward, OPDRewardParams

from test_distill_opd import Spy, domains_dataset, rollout


class StandInVLLM:
    """A vLLM OpenAI-compatible server in a thread, serving one causal LM (or misbehaving on request)."""

    def __init__(self, model_dir, tokenizer=None, name="teacher", raw_logprobs=False, drop_actual=False,
                 models=None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(model_dir)
        self.names = models or [name]
        self.raw_logprobs, self.drop_actual = raw_logprobs, drop_actual
        self.requests: list[tuple[str, dict]] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, body, status=200):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    models = [{"id": n, "object": "model"} for n in stand_in.names]
                    return self._reply({"object": "list", "data": models})
                self._reply({"error": "not found"}, 404)

            def do_POST(self):
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stand_in.requests.append((self.path, payload))
                if self.path == "/tokenize":
                    special = payload.get("add_special_tokens", True)
                    ids = stand_in.tokenizer(payload["prompt"], add_special_tokens=special)["input_ids"]
                    return self._reply({"count": len(ids), "max_model_len": 512, "tokens": ids})
                if self.path == "/v1/completions":
                    return self._reply(stand_in.completions(payload))
                self._reply({"error": "not found"}, 404)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @torch.no_grad()
    def completions(self, payload):
        temperature = 1.0 if self.raw_logprobs else payload.get("temperature", 1.0)
        k = payload["prompt_logprobs"]
        choices = []
        for index, sequence in enumerate(payload["prompt"]):
            ids = torch.tensor([sequence])
            logps = torch.log_softmax(self.model(input_ids=ids).logits[0].float() / temperature, -1)
            entries = [None]
            for position in range(1, len(sequence)):
                dist = logps[position - 1]
                order = torch.argsort(dist, descending=True)
                ranks = {int(t): r + 1 for r, t in enumerate(order[:k].tolist())}
                actual = sequence[position]
                keep = list(ranks) + ([] if self.drop_actual or actual in ranks else [actual])
                if self.drop_actual:
                    keep = [t for t in keep if t != actual] or [int(order[1])]
                entries.append({str(t): {"logprob": float(dist[t]),
                                         "rank": ranks.get(t, int((dist > dist[t]).sum()) + 1),
                                         "decoded_token": self.tokenizer.decode([t])} for t in keep})
            choices.append({"index": index, "text": "x", "finish_reason": "length", "prompt_logprobs": entries})
        return {"id": "cmpl-0", "object": "text_completion", "model": self.names[0], "choices": choices}

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return str(materialize_model("tiny-qwen2", tmp_path_factory.mktemp("served") / "teacher", seed=1))


@pytest.fixture
def served(teacher_dir):
    servers = []

    def start(**kwargs):
        servers.append(StandInVLLM(teacher_dir, **kwargs))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def test_served_teacher_gives_the_local_teachers_advantages(tiny_trainer, teacher_dir, served):
    server = served()
    plugin = OPDReward(OPDRewardParams(), teacher=f"vllm:{server.url}")
    spy = Spy(plugin)
    trainer = tiny_trainer("grpo", plugins=[plugin], args={"temperature": 0.7})
    out = rollout(trainer)
    batch, mask = spy.batch, out["completion_mask"].bool()

    local = OPDReward(OPDRewardParams(), teacher=teacher_dir)
    expected = local.trl_ext_compute_advantages(rewards=spy.rewards, batch=batch)
    assert torch.allclose(out["advantages"][mask], expected[mask], atol=1e-5)
    assert (out["advantages"][~mask] == 0).all() and out["advantages"][mask].abs().min() > 0

    # the scoring request is TRL's: unpadded prompt + completion ids, one token, the trainer's temperature
    scoring = [p for route, p in server.requests if route == "/v1/completions"]
    request = scoring[-1]
    assert request["max_tokens"] == 1 and request["temperature"] == 0.7 and request["prompt_logprobs"] == 1
    for row, sequence in enumerate(request["prompt"]):
        n = int(batch.completion_mask[row].nonzero().max()) + 1
        assert sequence == (batch.prompt_ids[row][batch.prompt_mask[row].bool()].tolist()
                            + batch.completion_ids[row][:n].tolist())


def test_parsing_agrees_with_trls_vllm_client_parser(teacher_dir, served):
    """The same response, read by TRL's parser of vLLM's prompt_logprobs and by ours."""
    from trl.generation.vllm_client import VLLMClient

    server = served()
    teacher = tch.ServedTeacher(server.url, temperature=0.9)
    teacher.connect()
    sequences = [[5, 17, 33, 2, 40, 41], [7, 7, 9]]
    ours = teacher._prompt_logps(sequences, 0.9)
    reply = server.completions({"prompt": sequences, "prompt_logprobs": 1, "temperature": 0.9})
    for choice, sequence, row in zip(reply["choices"], sequences, ours):
        trl = VLLMClient._format_sequence_logprobs(choice, sequence, 1, 1)["actual_logprobs"]
        assert [v[0] for v in trl] == row[1:]


def test_multi_teacher_mixes_a_served_and_a_local_teacher(tiny_trainer, teacher_dir, served, tmp_path):
    server = served()
    other = str(materialize_model("tiny-qwen2", tmp_path / "other", seed=2))
    refs = {"a": f"vllm:{server.url}", "b": other}
    plugin = MultiTeacherOPD(MultiTeacherParams(teachers=refs, weights={"a": 2.0}, max_resident_teachers=1))
    spy = Spy(plugin)
    out = rollout(tiny_trainer("grpo", plugins=[plugin], dataset=domains_dataset()))  # rows 0-3 domain a
    local = MultiTeacherOPD(MultiTeacherParams(teachers={"a": teacher_dir, "b": other}, weights={"a": 2.0}))
    expected = local.trl_ext_compute_advantages(rewards=spy.rewards, batch=spy.batch)
    assert torch.allclose(out["advantages"], expected, atol=1e-5)
    # the served teacher saw domain a's rows only, and is not a resident model
    scoring = [p for route, p in server.requests if route == "/v1/completions"]
    assert len(scoring) == 1 and len(scoring[0]["prompt"]) == 4
    assert list(plugin.pool.loaded) == ["b"] and plugin.pool.loads == 1


def test_opd_trains_against_a_served_teacher(tiny_trainer, served):
    server = served()
    trainer = tiny_trainer("grpo", plugins=[OPDReward(OPDRewardParams(), teacher=f"vllm:{server.url}")],
                           args={"learning_rate": 1e-3})
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert sum(route == "/v1/completions" for route, _ in server.requests) == 2  # one request per step


# -- bad servers ----------------------------------------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _different_tokenizer():
    """A tokenizer of another family, trained in code on a few sentences (byte-level BPE, its own ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel()
    raw.train_from_iterator(["The quick brown fox jumps over 12 lazy dogs."] * 4,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", unk_token="<unk>")


def _student_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_unreachable_server_is_named():
    url = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(tch.TeacherError, match=f"served teacher vllm:{url}: v1/models failed"):
        tch.ServedTeacher(url, timeout=5).connect()


def test_server_with_another_tokenizer_is_refused(served, tiny_model_dir):
    server = served(tokenizer=_different_tokenizer())
    with pytest.raises(tch.TeacherError, match="different tokenizers"):
        tch.ServedTeacher(server.url).connect(_student_tokenizer(tiny_model_dir), "student")


def test_server_ignoring_the_temperature_is_refused(served, tiny_model_dir):
    server = served(raw_logprobs=True)
    with pytest.raises(tch.TeacherError, match="--logprobs-mode processed_logprobs"):
        tch.ServedTeacher(server.url, temperature=0.7).connect(_student_tokenizer(tiny_model_dir))
    tch.ServedTeacher(server.url, temperature=1.0).connect(_student_tokenizer(tiny_model_dir))  # no difference at 1


def test_server_with_several_models_is_refused(served):
    server = served(models=["a", "b"])
    with pytest.raises(tch.TeacherError, match=r"serves 2 models \['a', 'b'\]; start one vLLM server per teacher"):
        tch.ServedTeacher(server.url).connect()


def test_answer_without_the_sampled_token_is_refused(served):
    server = served(drop_actual=True)
    teacher = tch.ServedTeacher(server.url)
    teacher.connect()
    with pytest.raises(tch.TeacherError, match="no finite log-probability for token 17 at position 1"):
        teacher._prompt_logps([[5, 17, 33]], 1.0)


# -- recipes ---------------------------------------------------------------------------------------------------------


def _grpo(plugins, teacher=None, trainer="grpo", model="embedded:tiny-qwen2"):
    return {"name": "opd", "trainer": trainer, "model": model, "teacher": teacher, "plugins": plugins,
            "dataset": {"source": "embedded:arithmetic", "params": {"format": "prompt"}}}


def _problems(stage):
    """Every message the recipe validator and the stage resolver give (what `trl-ext validate` prints)."""
    from trl_ext.catalog import Catalog

    catalog = Catalog.discover()
    errors = validate_recipe(Recipe.model_validate({"stages": [stage]}), catalog)
    try:
        resolve_stage(StageSpec.model_validate(stage), 0, catalog)
    except RecipeError as exc:
        errors.append(str(exc))
    return "\n".join(errors)


def test_recipe_takes_a_served_teacher():
    assert _problems(_grpo(["opd_reward", "exact_match"], teacher="vllm:http://127.0.0.1:8000")) == ""
    teachers = {"a": "vllm:http://127.0.0.1:8000", "b": "embedded:tiny-qwen2"}
    assert _problems(_grpo([{"multi_teacher_opd": {"teachers": teachers}}, "exact_match"])) == ""


@pytest.mark.parametrize("stage, message", [
    (_grpo(["opd_reward", "exact_match"], teacher="vllm:127.0.0.1:8000"),
     "served teacher 'vllm:127.0.0.1:8000' needs the server's http(s) URL"),
    (_grpo([{"multi_teacher_opd": {"teachers": {"a": "vllm:ftp://host"}}}, "exact_match"]),
     "teacher 'a': served teacher 'vllm:ftp://host' needs the server's http(s) URL"),
    (_grpo(["gkd"], teacher="vllm:http://127.0.0.1:8000", trainer="distillation"),
     "stages[0].teacher: the distillation trainer reads the teacher's whole distribution"),
    (_grpo(["opd_reward", "exact_match"], teacher="embedded:tiny-qwen2", model="vllm:http://127.0.0.1:8000"),
     "stages[0].model: 'vllm:http://127.0.0.1:8000': only a teacher can be served"),
])
def test_bad_served_teacher_references_are_refused(stage, message):
    assert message in _problems(stage)
