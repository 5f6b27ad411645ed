"""Any policy on a suite game: an Agent's greedy policy, a reply function, an OpenAI-compatible endpoint (a local
stub server, never the network), all evaluated exactly through one play-out."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import gymnasium as gym
import pytest

from llamagym.envs import AgentPolicy, Game, TextPolicy, evaluate, markov, openai_chat
from llamagym.envs.suite import Transition, play_out, summary
from tests.envs import CountingEnv, YesNoAgent

TURNS = 3  # CountingEnv: the observation is the turn number, action 1 earns 1, it ends after TURNS turns


def steps_evaluate(decide):
    out = play_out([(1.0, 0, 0)], decide, lambda t, a: [Transition(1.0, t + 1, t + 1, float(a), t + 1 >= TURNS)])
    figures = summary(out, random=TURNS / 2, optimal=float(TURNS))
    return {**figures, "actions": out.leaves[0].actions}


gym.register(id="llamagym-test/Steps-v0", entry_point=CountingEnv, kwargs={"length": TURNS})
STEPS = Game("steps", "llamagym-test/Steps-v0", "unused", YesNoAgent, steps_evaluate, lambda obs: 1)


@pytest.fixture
def stub_server():
    """A local OpenAI-compatible server; the test sets `server.answer(body) -> content` and reads `server.seen`."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            server.seen.append((self.path, dict(self.headers), body))
            status, content = server.answer(body)
            payload = json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]})
            if status != 200:
                payload = json.dumps({"error": content})
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(payload.encode())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.seen, server.answer = [], lambda body: (200, "yes")
    server.url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_expert_decider_scores_one_and_a_bad_policy_zero():
    assert evaluate(STEPS, markov(lambda obs: 1))["normalised"] == pytest.approx(1.0)
    assert evaluate(STEPS, markov(lambda obs: 0))["normalised"] == pytest.approx(-1.0)


def test_openai_chat_sends_the_hooks_messages_greedily_and_its_answer_is_evaluated(stub_server):
    reply = openai_chat(stub_server.url, "stub-model", api_key="secret")
    figures = evaluate(STEPS, reply)
    assert figures["score"] == pytest.approx(3.0) and figures["invalid_rate"] == 0.0
    path, headers, body = stub_server.seen[0]
    assert path == "/v1/chat/completions" and headers["Authorization"] == "Bearer secret"
    assert body["model"] == "stub-model" and body["temperature"] == 0.0
    assert body["messages"] == [{"role": "system", "content": "Say yes or no."}, {"role": "user", "content": "Turn 0."}]
    # context_turns is None: the second turn's messages carry the first exchange
    assert stub_server.seen[1][2]["messages"][1:] == [
        {"role": "user", "content": "Turn 0."},
        {"role": "assistant", "content": "yes"},
        {"role": "user", "content": "Turn 1."},
    ]


def test_unparsable_replies_play_the_fallback_and_are_counted(stub_server):
    stub_server.answer = lambda body: (200, "I am not sure.")
    figures = evaluate(STEPS, openai_chat(stub_server.url, "m"))
    assert figures["invalid_rate"] == 1.0 and figures["score"] == 0.0  # fallback_action defaults to 0


def test_http_errors_and_unreachable_servers_are_clear(stub_server):
    stub_server.answer = lambda body: (500, "overloaded")
    with pytest.raises(RuntimeError, match="HTTP 500.*overloaded"):
        openai_chat(stub_server.url, "m")([{"role": "user", "content": "hi"}])
    port = stub_server.server_address[1]
    stub_server.shutdown()
    stub_server.server_close()
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}.*Is the server running"):
        openai_chat(f"http://127.0.0.1:{port}/v1", "m", timeout=5)([{"role": "user", "content": "hi"}])


def test_a_policy_lists_what_it_replied_in_each_state_once():
    answers = iter(["yes", "I am not sure.", "yes"])
    decide = TextPolicy(lambda messages: next(answers), YesNoAgent)
    steps_evaluate(decide)
    assert decide([[0], [0, 1]]) == [1, 0]  # asked again: remembered, not asked twice
    assert decide.replies() == [
        ((0,), "yes", 1, True),
        ((0, 1), "I am not sure.", 0, False),  # unparsable: the fallback action was played
        ((0, 1, 2), "yes", 1, True),
    ]


def test_text_policy_keeps_only_context_turns_exchanges():
    seen = []

    def reply(messages):
        seen.append(messages)
        return "no"

    class OneTurnContext(YesNoAgent):
        context_turns = 1

    steps_evaluate(TextPolicy(reply, OneTurnContext))
    assert [m["content"] for m in seen[2][1:]] == ["Turn 1.", "no", "Turn 2."]


@pytest.mark.parametrize("mode", ["score", "generate"])
def test_agent_policy_replays_exactly_what_the_greedy_agent_plays(model, tokenizer, mode):
    """The evaluator's paths rebuild the agent's own conversation: its greedy actions equal those of act()."""
    agent = YesNoAgent(model, tokenizer, action_mode=mode, generation_config={"max_new_tokens": 3})
    evaluated = steps_evaluate(AgentPolicy(agent))["actions"]
    env, played = CountingEnv(length=TURNS), []
    observation, _ = env.reset()
    with agent.evaluating(), agent.policy.float32():
        for _ in range(TURNS):
            played.append(agent.act(observation))
            observation, reward, *_ = env.step(played[-1])
            agent.assign_reward(reward)
        agent.terminate_episode()
    assert list(evaluated) == played
    assert agent.batch == []  # evaluation trains on nothing


def test_a_markov_agent_policy_equals_predict(model, tokenizer):
    class MarkovSteps(YesNoAgent):
        context_turns = 0

    agent = MarkovSteps(model, tokenizer)
    figures = evaluate(STEPS, agent)
    assert figures["actions"] == tuple(agent.predict(list(range(TURNS))))
    assert figures["invalid_rate"] == 0.0  # scoring mode: every reply is valid
