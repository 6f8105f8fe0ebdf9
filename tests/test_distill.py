"""On-policy distillation (`distill`, `algorithm.name=opd`), in process:
- the per-token advantage -(log pi_student - log pi_teacher) and the gradient it gives through the objective's
  loss, by hand; its mix with a reward advantage; observation tokens never scored;
- the `distill` section's rules and the teacher's tokenizer refused by its first difference;
- the teacher scoring in the rollout runtime (sync, one_step_off, fully_async): every trained token's advantage
  from its teacher score, `distill/reverse_kl`; a dead teacher stops the step with its reason, no batch made;
- multi-turn episodes (the calculator, in the runtime) and an agent's gateway segments (a rewritten history): the
  model's tokens of every turn and segment distilled, the tool output and user messages between them never."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from mrl_engine import FakeEngine, fake_runtime
from test_envs import CALL, IM_END, TOK, chars, row
from test_gateway import REWRITE_OUTPUTS, REWRITE_PROMPTS, USER_DELTA, rendered, rewrite_step

from megatron_rl.config import Config, ConfigError, load_config, loss_spec, preset
from megatron_rl.envs import Trajectory
from megatron_rl.loop.distill import check_teacher_tokenizer
from megatron_rl.loop.runtime import RolloutData, RolloutRuntime
from megatron_rl.loop.samples import advantages_of, distill_advantage
from megatron_rl.losses.objective import policy_loss
from megatron_rl.parallel.launch import free_port
from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.rollout.event_loop import RolloutLoop
from megatron_rl.rollout.sglang import SGLangClient
from megatron_rl.rollout.teacher import TeacherError, tokenizer_difference
from megatron_rl.rollout.types import Sample

G = 2


def trajectory(output: list[int], student: list[float], teacher: list[float], mask: list[bool]) -> Trajectory:
    return Trajectory([1, 2], output, student, "stop", loss_mask=mask, turn_of_token=[0] * len(output),
                      turn_rewards=[0.0], teacher_logprobs=teacher)  # fmt: skip


# generated, generated, an observation (log-prob 0, never scored), generated
EPISODE = trajectory([5, 6, 7, 8], [-1.0, -0.5, 0.0, -2.0], [-0.25, -1.5, -3.0, -1.0], [True, True, False, True])


def config(*overrides: str) -> Config:
    return load_config(None, ["distill.teacher=/teacher", f"rollout.n_samples_per_prompt={G}", *overrides])


def test_distill_advantage_by_hand_alone_and_beside_a_reward() -> None:
    assert distill_advantage(EPISODE).tolist() == [0.75, -1.0, 0.0, 1.0]  # teacher - student; 0 on the observation
    opd = config("algorithm.name=opd", "distill.kl_coef=0.5")
    assert advantages_of(opd, torch.tensor([1.0, 0.0]), [EPISODE, EPISODE])[0].tolist() == [0.375, -0.5, 0.0, 0.5]
    # GRPO's outcome advantage (+-0.5: mean-only) plus the distillation term, per token
    rl = config("algorithm.name=grpo", "algorithm.adv_norm_std=false", "distill.kl_coef=2")
    got = advantages_of(rl, torch.tensor([1.0, 0.0]), [EPISODE, EPISODE])
    assert [a.tolist() for a in got] == [[2.0, -1.5, 0.5, 2.5], [1.0, -2.5, -0.5, 1.5]]


def test_an_unscored_sample_is_never_trained_on() -> None:
    unscored = trajectory([5, 6], [-1.0, -1.0], [-1.0], [True, True])
    unscored.teacher_logprobs = None
    with pytest.raises(RuntimeError, match="has None teacher log-probs for 2 output tokens"):
        advantages_of(config(), torch.tensor([1.0, 0.0]), [unscored, unscored])


def test_the_gradient_through_the_opd_loss_by_hand() -> None:
    """Uniform logits over 3 tokens, on-policy (ratio 1): the token-mean surrogate -(1/3) sum_t A_t r_t has the
    gradient -(A_t / 3) (onehot(y_t) - 1/3) on the logits of token t: descent on the reverse KL's estimate."""
    logits = torch.zeros(1, 3, 3, requires_grad=True)
    sampled = torch.tensor([[0, 2, 1]])
    log_probs = torch.log_softmax(logits, -1).gather(2, sampled.unsqueeze(2)).squeeze(2)
    advantages = torch.tensor([[0.75, -1.0, 1.0]])  # teacher - student of three sampled tokens
    loss, _ = policy_loss(log_probs, log_probs.detach(), advantages, torch.ones(1, 3), loss_spec(preset("opd")))
    loss.backward()
    expected = torch.tensor([[-1 / 6, 1 / 12, 1 / 12], [-1 / 9, -1 / 9, 2 / 9], [1 / 9, -2 / 9, 1 / 9]])
    torch.testing.assert_close(logits.grad[0], expected, rtol=0, atol=1e-7)
    assert float(loss.detach()) == pytest.approx(-(0.75 - 1.0 + 1.0) / 3)  # -(1/N) sum_t A_t r_t at r_t = 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["distill.teacher=null", "algorithm.name=opd"], "algorithm.name = 'opd' distils from a teacher"),
        (["distill.teacher_urls=[http://h:1]"], "distill.teacher .* and distill.teacher_urls: give one"),
        (["distill.teacher=null", "distill.teacher_urls=[http://h:1]"], "distill.teacher_urls need distill.tokenizer"),
        (["distill.teacher=null", "distill.teacher_urls=[h:1]", "distill.tokenizer=/t"], r"teacher_urls\[0\] = 'h:1'"),
        (["algorithm.kl_in_reward=true", "algorithm.kl_coef=0.1"], "algorithm.kl_in_reward = true"),
        (["algorithm.name=gspo"], "algorithm.ratio_level = 'sequence'"),
        (["distill.kl_coef=0"], "distill.kl_coef = 0"),
        (["distill.teacher=null", "distill.tokenizer=/t"], "distill.tokenizer is set but there is no teacher"),
    ],
)
def test_distill_rules_name_the_keys(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config(*overrides)


class Vocab:
    def __init__(self, vocab: dict[str, int], eos: int) -> None:
        self.vocab, self.eos_token_id = vocab, eos

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)


def test_tokenizer_differences_are_named(tmp_path: Path) -> None:
    import tiny_model

    base = {"a": 0, "b": 1, "c": 2}
    assert tokenizer_difference(Vocab(base, 2), Vocab(dict(base), 2)) is None
    assert tokenizer_difference(Vocab(base, 2), Vocab({"a": 0, "c": 1, "b": 2}, 2)) == (
        "token id 1 is 'b' for the student, 'c' for the teacher"
    )
    assert (
        tokenizer_difference(Vocab(base, 2), Vocab(base, 0)) == "eos_token_id is 2 for the student, 0 for the teacher"
    )
    student = tiny_model.build_tokenizer()
    tiny_model.save_tokenizer(student, tmp_path / "same")
    other = tiny_model.build_tokenizer()
    other.add_tokens(["<teacher-only>"])
    other.save_pretrained(tmp_path / "other")
    check_teacher_tokenizer(config(f"distill.teacher={tmp_path / 'same'}"), student)
    size = len(student.get_vocab())
    with pytest.raises(ConfigError, match=(
        rf"distill.tokenizer = '.*other': the teacher's tokenizer differs from the student's \(the student's "
        rf"vocabulary has {size} tokens, the teacher's {size + 1}\)"
    )):  # fmt: skip
        check_teacher_tokenizer(config("distill.teacher=null", "distill.teacher_urls=[http://h:1]",
                                       f"distill.tokenizer={tmp_path / 'other'}"), student)  # fmt: skip


def test_a_deeper_teacher_of_the_same_tokenizer_is_taken(tmp_path: Path) -> None:
    """run.sh's DISTILL=4to2: tiny_model.py's 4-layer teacher and its 2-layer student (`--layers 2`) share the
    tokenizer; the run validates with the student's depth from its config.json, the teacher's being no rule."""
    from megatron_rl.data import load_tokenizer
    from megatron_rl.validation import validate_run

    import tiny_model

    teacher = tiny_model.build_model(tmp_path / "teacher")
    student = tiny_model.build_model(tmp_path / "student", layers=2)
    assert (teacher.config.num_hidden_layers, student.config.num_hidden_layers) == (4, 2)
    # a layer: attention 4 x 128 x 128 - 2 x 128 x 64 + 2 x 32 (QK-norm), 8 experts x 3 x 128 x 128, a 128 x 8
    # router, 2 norms of 128: 443,712; the model 1,782,144 with 4 layers
    assert sum(p.numel() for p in student.parameters()) == 1_782_144 - 2 * 443_712
    prompt = {"prompt": [{"role": "user", "content": "2+3="}], "reward_model": {"ground_truth": "5"}}
    (tmp_path / "train.jsonl").write_text(json.dumps(prompt) + "\n")
    cfg = validate_run(
        config("algorithm.name=opd", f"model.hf_path={tmp_path / 'student'}", f"distill.teacher={tmp_path / 'teacher'}",
               f"data.train_path={tmp_path / 'train.jsonl'}", "parallel.expert_model_parallel_size=2"),
        "train", world_size=2, cuda_available=False,
    )  # fmt: skip
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_experts) == (2, 128, 8)
    check_teacher_tokenizer(cfg, load_tokenizer(tmp_path / "student", "model.hf_path"))


# ---- in the rollout runtime ----
class TwoTokens(FakeEngine):
    """Every response: tokens 7, 8 with sampling log-probs -0.5, -1.0, of weight version 0."""

    def answer(self, ids: list[int], params: Any, routed: bool) -> Sample:
        return Sample(list(ids), [7, 8], [-0.5, -1.0], "stop", weight_version="0")


class FakeTeacher:
    """Scores token t as -t / 10; records the requests."""

    def __init__(self) -> None:
        self.asked: list[tuple[int, int]] = []  # (sequence length, start)
        self.sequences: list[list[int]] = []
        self.closed = False

    async def prompt_logprobs(self, sequences: Any, starts: Any) -> list[list[float]]:
        self.asked += [(len(s), k) for s, k in zip(sequences, starts, strict=True)]
        self.sequences += [list(s) for s in sequences]
        return [[-t / 10 for t in s[k:]] for s, k in zip(sequences, starts, strict=True)]

    def close(self) -> None:
        self.closed = True


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import tiny_model
    import tiny_task

    root = tmp_path_factory.mktemp("distill_data")
    tiny_model.save_tokenizer(tiny_model.build_tokenizer(), root / "tokenizer")
    train_rows, _ = tiny_task.split_problems(seed=0)
    rows = [json.dumps(tiny_task.task_row(p, i, "train")) for i, p in enumerate(train_rows[:12])]
    (root / "train.jsonl").write_text("\n".join(rows) + "\n")
    (root / "rewards.py").write_text("def one(response: str, answer: str) -> float:\n    return 1.0\n")
    return root


def runtime_config(root: Path, *overrides: str) -> Config:
    return load_config(None, [
        f"data.train_path={root / 'train.jsonl'}", f"data.tokenizer_path={root / 'tokenizer'}", "data.shuffle=false",
        "data.max_prompt_tokens=64", "reward.type=custom", f"reward.custom_function={root / 'rewards.py'}:one",
        f"rollout.n_samples_per_prompt={G}", "train.prompts_per_step=2", "train.steps=3", "algorithm.name=opd",
        f"distill.teacher={root / 'tokenizer'}", "distill.kl_coef=0.5", *overrides,
    ])  # fmt: skip


def runtime(cfg: Config, root: Path, teacher: Callable[[RolloutLoop], Any]) -> RolloutRuntime:
    """The runtime around `TwoTokens` and the teacher `teacher` builds on the runtime's loop."""
    data = RolloutData.load(cfg)
    return RolloutRuntime(
        cfg, data, model_path=None, engine_log=root / "engine.log", engine=TwoTokens(), teacher=teacher(data.loop)
    )


@pytest.mark.parametrize("mode", ["sync", "one_step_off", "fully_async"])
def test_the_teacher_scores_every_trained_sample_in_each_async_mode(data_dir: Path, rank0_env: None, mode: str) -> None:
    teacher = FakeTeacher()
    driver = runtime(runtime_config(data_dir, f"rollout.async_mode={mode}"), data_dir, lambda loop: teacher)
    try:
        for step in (1, 2):
            plan = driver.collect(step, step - 1)
            driver.finish_step()
            assert plan.batch is not None and plan.batch.advantages is not None
            assert len(plan.batch.advantages) == 2 * G
            for advantage in plan.batch.advantages:  # 0.5 x (teacher - student) of tokens 7, 8
                torch.testing.assert_close(advantage, torch.tensor([0.5 * (-0.7 + 0.5), 0.5 * (-0.8 + 1.0)]))
            # log pi_student - log pi_teacher per generated token: (-0.5 + 0.7 - 1.0 + 0.8) / 2
            assert plan.metrics["distill/reverse_kl"] == pytest.approx(0.0)
            # since the last step's record (fully_async's producer may have scored step 2's groups before it)
            assert plan.metrics["distill/teacher_tokens_per_s"] > 0 or step == 2
            assert plan.metrics["time/teacher"] >= 0
            if mode != "fully_async":  # data/epoch: 2 prompts a step of the 12 (the producer draws ahead)
                assert plan.metrics["data/epoch"] == 2 * step / 12
    finally:
        driver.close()
        driver.data.close()
    assert all(length - start == 2 for length, start in teacher.asked)  # the prompt sent, never scored
    assert teacher.closed


def test_a_dead_teacher_stops_the_step_after_its_retries(data_dir: Path, rank0_env: None) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there

    def teacher(loop: RolloutLoop) -> RolloutEngine:
        return RolloutEngine(SGLangClient([dead], api_key="k", max_retries=1, backoff_s=0.01), loop)

    driver = runtime(runtime_config(data_dir), data_dir, teacher)
    try:
        with pytest.raises(TeacherError, match=(
            rf"the teacher could not score 4 sample\(s\): POST /generate .* failed after 2 tries; last server "
            rf"{dead}: connection refused.*; stopping \(nothing is trained on a missing teacher score\)"
        )):  # fmt: skip
            driver.collect(1, 0)
    finally:
        driver.close()
        driver.data.close()


# ---- multi-turn episodes and gateway segments ----
class CallsThenAnswers(FakeEngine):
    """Turn 0 of every episode calls the calculator, turn 1 answers; log-prob -0.01 * (k + 1) at position k of
    a turn."""

    def answer(self, ids: list[int], params: Any, routed: bool) -> Sample:
        gen = [*chars(CALL if ids == [7, 20, 30] else "Answer: 56088"), IM_END]
        return Sample(list(ids), gen, [-0.01 * (k + 1) for k in range(len(gen))], "stop")


def test_a_multi_turn_episode_is_distilled_on_the_models_tokens_of_every_turn(rank0_env: None) -> None:
    """The calculator: the teacher scores each episode's whole output once (its prompt unscored); the advantage is
    0.5 x (teacher - student) on the tokens of both turns, 0 on the tool's response, which the loss never sees."""
    cfg = load_config(None, [
        "model.hf_path=unused", "data.train_path=unused", f"rollout.n_samples_per_prompt={G}",
        "train.prompts_per_step=1", "env.type=calculator", "env.max_turns=3", "algorithm.name=opd",
        "distill.teacher=/teacher", "distill.kl_coef=0.5",
    ])  # fmt: skip
    teacher = FakeTeacher()
    driver = fake_runtime(cfg, CallsThenAnswers(), TOK, [row(7)], teacher=teacher)
    try:
        plan = driver.collect(1)
    finally:
        driver.close()
        driver.data.close()
    call, answer = [*chars(CALL), IM_END], [*chars("Answer: 56088"), IM_END]
    batch = plan.batch
    assert batch is not None and len(batch.advantages) == G
    for i in range(G):
        output = batch.tokens[i][batch.prompt_lengths[i] :].tolist()
        observation = output[len(call) : len(output) - len(answer)]
        assert output == call + observation + answer
        assert "<tool_response>\n56088\n</tool_response>" in TOK.decode(observation)
        mask = batch.response_mask[i].tolist()
        assert mask == [True] * len(call) + [False] * len(observation) + [True] * len(answer)
        want = [0.5 * (-t / 10 + 0.01 * (k + 1)) for k, t in enumerate(call)]
        want += [0.0] * len(observation) + [0.5 * (-t / 10 + 0.01 * (k + 1)) for k, t in enumerate(answer)]
        torch.testing.assert_close(batch.advantages[i], torch.tensor(want), rtol=0, atol=1e-6)
        # by hand: "<" (id 70) opens the call at student -0.01, teacher -7.0; "A" (id 75) opens the answer
        assert float(batch.advantages[i][0]) == pytest.approx(0.5 * (-7.0 + 0.01))
        assert float(batch.advantages[i][len(call) + len(observation)]) == pytest.approx(0.5 * (-7.5 + 0.01))
    assert teacher.asked == [(3 + len(output), 3)] * G  # each episode once, whole, after its 3 prompt tokens
    assert teacher.sequences == [[7, 20, 30, *output]] * G
    student = [-0.01 * (k + 1) for k in range(len(call))] + [-0.01 * (k + 1) for k in range(len(answer))]
    scores = [-t / 10 for t in call + answer]
    gap = sum(s - t for s, t in zip(student, scores, strict=True)) / len(student)
    assert plan.metrics["distill/reverse_kl"] == pytest.approx(gap)


def test_every_gateway_segment_is_distilled_on_its_own_and_user_messages_never() -> None:
    """An agent that rewrites its history (test_gateway's `rewriting_agent`): each of its three segments is sent
    to the teacher as a sequence of its own, and the user message inside the second is not distilled."""
    teacher = FakeTeacher()
    outcome, owner, rewriter = rewrite_step(
        teacher, **{"algorithm.name": "opd", "distill.teacher": "/teacher", "distill.kl_coef": "0.5"}
    )
    batch = outcome.batch
    mine = [i for i, e in enumerate(owner) if e == rewriter]
    seg_d = rendered([{"role": "user", "content": "seg-d"}])
    sent = [p + o for p, o in zip(REWRITE_PROMPTS, REWRITE_OUTPUTS, strict=True)]
    sent.append(seg_d + [*chars("Answer: 1"), IM_END])
    assert sorted(teacher.sequences) == sorted(sent)
    assert sorted(teacher.asked) == sorted(
        (len(s), len(p)) for s, p in zip(sent, [*REWRITE_PROMPTS, seg_d], strict=True)
    )

    def by_call(text: str) -> list[float]:  # one engine call's tokens: 0.5 x (teacher -t/10 - student -0.01 k)
        return [0.5 * (-t / 10 + 0.01 * k) for k, t in enumerate([*chars(text), IM_END])]

    wants = [
        by_call("thinking"),
        by_call("more") + [0.0] * len(USER_DELTA) + by_call("still"),
        by_call("Answer: 56088"),
    ]
    for i, want in zip(mine, wants, strict=True):
        torch.testing.assert_close(batch.advantages[i], torch.tensor(want), rtol=0, atol=1e-6)
    (theirs,) = [i for i, e in enumerate(owner) if e != rewriter]
    torch.testing.assert_close(batch.advantages[theirs], torch.tensor(by_call("Answer: 1")), rtol=0, atol=1e-6)
