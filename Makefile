.PHONY: install test lint format bench demo

install:
	python3 -m pip install "torch==2.13.0"
	python3 -m pip install -e ".[test,serve]"

test:
	python3 -m pytest -q

lint:
	ruff check .
	ruff format --check .

format:
	ruff check --fix .
	ruff format .

bench:
	python3 benchmarks/bench_w4a16.py

demo:
	quantfw demo
