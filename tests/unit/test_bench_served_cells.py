"""``tandem bench served``'s cells (rates and closed-loop concurrencies), the client's command line for
them, and the speculation A/B gain."""

from __future__ import annotations

import argparse

from cluster.bench.served import add_served_args, cells
from cluster.bench.served_report import speculation_gains
from cluster.bench.vllm_client import client_args


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_served_args(parser)
    return parser.parse_args(list(argv))


def test_concurrency_cells_beside_rate_cells():
    got = cells(_args("--datasets", "code", "--rates", "2", "--max-concurrency", "1", "8", "--num-prompts", "16"))
    assert [(c["name"], c["rate"], c["num_prompts"], c.get("concurrency")) for c in got] == [
        ("code @ 2/s", "2", 16, None), ("code @ c=1", "inf", 16, 1), ("code @ c=8", "inf", 16, 8)]
    assert [c["name"] for c in cells(_args("--datasets", "code", "--rates", "--max-concurrency", "4"))] == [
        "code @ c=4"]


def test_the_client_is_asked_for_the_concurrency_and_temperature():
    options = argparse.Namespace(url="http://x", model="m", tokenizer="t", seed=0, num_prompts=4, rate="inf",
                                 out="o.json", dataset="random", input_len=8, output_len=8, max_concurrency=8,
                                 temperature=0.0)
    argv = client_args(options)
    assert argv[argv.index("--max-concurrency") + 1] == "8"
    assert argv[argv.index("--temperature") + 1] == "0.0"
    del options.max_concurrency, options.temperature
    assert "--max-concurrency" not in client_args(options) and "--temperature" not in client_args(options)
    options.header = ["X-Tandem-Group=vllm"]
    argv = client_args(options)
    assert argv[argv.index("--header") + 1] == "X-Tandem-Group=vllm"


def test_a_vllm_group_is_served_pinned_beside_the_native_one(monkeypatch, tmp_path):
    from cluster.bench import served

    started, sent = [], []

    class Server:
        url = "http://h:1"

        def stop(self) -> None:
            pass

    def client(args, url, cell, out):
        sent.append((cell["name"], cell["group"]))
        return {"output_throughput": 10.0 if cell["group"] == "native" else 8.0, "median_tpot_ms": 5.0}

    monkeypatch.setattr(served, "python_with_vllm", lambda: "/venv/bin/python")
    monkeypatch.setattr(served, "start_tandem", lambda name, config, spec, python: started.append(
        (name, config, spec, python)) or Server())
    monkeypatch.setattr(served, "_client", client)
    monkeypatch.setattr(served, "read_counters", lambda url: {})
    monkeypatch.setattr(served, "read_timeline", lambda url, seconds: None)
    args = _args("configs/vllm-group.yaml", "--vllm-group", "vllm", "--datasets", "random", "--rates", "2")
    import io

    from rich.console import Console

    console = Console(file=io.StringIO())
    report = served._measure_groups(args, console)
    assert [s[0] for s in started] == ["tandem", "vllm-group"]
    assert {s[3] for s in started} == {"/venv/bin/python"} and all(s[2] for s in started)
    assert sent == [("random @ 2/s", "native"), ("random @ 2/s", "vllm")]
    assert report["vllm_ratios"]["random @ 2/s"]["output_throughput"]["median"] == 10.0 / 8.0
    assert report["settings"]["groups"] == {"tandem": "native", "vllm-group": "vllm"}
    served.print_served_report(console, report)
    printed = console.file.getvalue()
    assert "tandem and vllm" in printed and "tandem and llamacpp" not in printed  # no table for a peer not served
    for bad, words in ((("configs/vllm-group.yaml", "--vllm-group", "native"), "no replica group of that name"),
                       (("configs/vllm-group.yaml", "--vllm-group", "vllm", "--rounds", "2"), "no --speculation-ab")):
        try:
            served._measure_groups(_args(*bad), console)
        except ValueError as err:
            assert words in str(err)
        else:
            raise AssertionError(f"{bad} was taken")


def test_speculation_gain_is_the_ratio_of_the_rounds_means():
    cell = "code @ c=1"
    systems = {"tandem #1": {cell: {"median_tpot_ms": 10.0, "output_throughput": 100.0}},
               "tandem-no-spec #1": {cell: {"median_tpot_ms": 30.0, "output_throughput": 40.0}},
               "tandem #2": {cell: {"median_tpot_ms": 14.0, "output_throughput": 80.0}},
               "tandem-no-spec #2": {cell: {"median_tpot_ms": 30.0, "output_throughput": 40.0}}}
    gains = speculation_gains(systems)[cell]
    assert gains["median_tpot_ms"] == 30.0 / 12.0  # lower is better: off / on
    assert gains["output_throughput"] == 90.0 / 40.0
    assert speculation_gains({"tandem": systems["tandem #1"]}) == {}
    # One round: the runs carry no round number.
    one = speculation_gains({"tandem": systems["tandem #1"], "tandem-no-spec": systems["tandem-no-spec #1"]})
    assert one[cell]["median_tpot_ms"] == 3.0


def test_alternative_configs_run_in_each_round_between_the_config_and_none(tmp_path):
    from cluster.bench.served import speculation_runs

    args = _args("configs/local.yaml", "--speculation-ab", "2", "--speculation-alternatives",
                 str(tmp_path / "suffix.yaml"), str(tmp_path / "ngram-k4.yaml"))
    runs = speculation_runs(args)
    assert [(name, config.name, on) for name, config, on in runs] == [
        ("tandem", "local.yaml", True), ("tandem:suffix", "suffix.yaml", True),
        ("tandem:ngram-k4", "ngram-k4.yaml", True), ("tandem-no-spec", "local.yaml", False)]
    clash = _args("--speculation-ab", "1", "--speculation-alternatives", "a/x.yaml", "b/x.yaml")
    try:
        speculation_runs(clash)
    except ValueError as err:
        assert "share a file name" in str(err)
    else:
        raise AssertionError("two alternatives named alike were taken")


def test_each_alternative_gets_its_own_gain_over_none():
    cell = "code @ c=8"
    systems = {"tandem": {cell: {"median_tpot_ms": 20.0}}, "tandem:suffix": {cell: {"median_tpot_ms": 10.0}},
               "tandem-no-spec": {cell: {"median_tpot_ms": 30.0}}}
    assert speculation_gains(systems)[cell]["median_tpot_ms"] == 1.5
    assert speculation_gains(systems, "tandem:suffix")[cell]["median_tpot_ms"] == 3.0


def test_one_round_prints_the_gain_table_beside_the_vllm_table():
    import io

    from rich.console import Console

    from cluster.bench.served_report import print_served_report

    cell = "code @ c=1"
    figures = {"median_tpot_ms": 10.0, "output_throughput": 90.0}
    report = {"systems": {"tandem": {cell: figures}, "tandem:suffix": {cell: dict(
                              figures, median_tpot_ms=5.0, acceptance_rate=0.625, num_preemptions=3.0)},
                          "tandem-no-spec": {cell: {"median_tpot_ms": 20.0, "output_throughput": 45.0}}},
              "settings": {"speculation_alternatives": {"tandem:suffix": "suffix.yaml"}}}
    out = io.StringIO()
    print_served_report(Console(file=out, width=200), report)
    text = out.getvalue()
    assert "speculation against none" in text and "gain tandem:suffix" in text
    assert "4.0" in text and "2.0" in text  # suffix's and the config's TPOT gains
    accepted = next(line for line in text.splitlines() if "drafts accepted" in line)
    assert accepted.split()[3:] == ["-", "62.5", "-"]  # per run, as read from its server's /metrics
    assert "preemptions" in text and "tokens a drafting step" not in text  # no run had it


def test_the_client_ignores_eos_unless_the_bench_honours_it():
    options = argparse.Namespace(url="http://x", model="m", tokenizer="t", seed=0, num_prompts=4, rate="inf",
                                 out="o.json", dataset="random", input_len=8, output_len=8)
    assert "--ignore-eos" in client_args(options)
    options.honor_eos = True
    assert "--ignore-eos" not in client_args(options)
    assert _args("--honor-eos").honor_eos and not _args().honor_eos


def _round(tandem_tps: float, tandem_ttft: float, vllm_tps: float, vllm_ttft: float) -> tuple[dict, dict]:
    cell = "random @ 2/s"
    return ({cell: {"output_throughput": tandem_tps, "mean_ttft_ms": tandem_ttft}},
            {cell: {"output_throughput": vllm_tps, "mean_ttft_ms": vllm_ttft}})


def test_rounds_are_compared_within_themselves_and_judged_by_the_median():
    from cluster.bench.served_report import server_ratios, server_rounds

    systems = {}
    # Round 2 fell on a slow spell for Tandem, round 3 for vLLM: each round's ratio is its own.
    for r, figures in enumerate([(110.0, 100.0, 100.0, 120.0), (80.0, 150.0, 100.0, 120.0),
                                 (100.0, 100.0, 80.0, 150.0)], start=1):
        t, v = _round(*figures)
        systems[f"tandem #{r}"], systems[f"vllm-all-cores #{r}"] = t, v
        systems[f"vllm-default #{r}"] = {"random @ 2/s": {"output_throughput": 10.0, "mean_ttft_ms": 1.0}}
    assert server_rounds(systems)[1] == ("tandem #2", ["vllm-all-cores #2", "vllm-default #2"])
    ratios = server_ratios(systems)["random @ 2/s"]
    # Each round against its better placement (by throughput: all-cores), never the other round's.
    assert ratios["output_throughput"]["rounds"] == [1.1, 0.8, 1.25]
    assert ratios["output_throughput"]["median"] == 1.1 and ratios["output_throughput"]["ahead"]
    assert ratios["mean_ttft_ms"]["rounds"] == [100 / 120, 150 / 120, 100 / 150]
    assert ratios["mean_ttft_ms"]["median"] == 100 / 120 and ratios["mean_ttft_ms"]["ahead"]  # lower is better


def test_one_round_keeps_its_names_and_a_speculation_ab_has_no_server_rounds():
    from cluster.bench.served_report import server_ratios, server_rounds

    t, v = _round(90.0, 130.0, 100.0, 120.0)
    one = {"tandem": t, "vllm-default": v}
    assert server_rounds(one) == [("tandem", ["vllm-default"])]
    assert server_ratios(one)["random @ 2/s"]["output_throughput"] == {"rounds": [0.9], "median": 0.9,
                                                                       "ahead": False}
    assert server_rounds({"tandem #1": t, "tandem-no-spec #1": t}) == []


def test_the_report_prints_each_rounds_ratio_and_the_median():
    import io

    from rich.console import Console

    from cluster.bench.served_report import print_served_report

    systems = {}
    for r, figures in enumerate([(120.0, 100.0, 100.0, 100.0), (90.0, 100.0, 100.0, 100.0)], start=1):
        systems[f"tandem #{r}"], systems[f"vllm-all-cores #{r}"] = _round(*figures)
    out = io.StringIO()
    print_served_report(Console(file=out, width=250), {"systems": systems, "offline": {
        "random @ 2/s": {"output_throughput": 210.0}}})
    text = out.getvalue()
    assert "ratio #1" in text and "ratio #2" in text and "median" in text
    throughput_row = next(line for line in text.splitlines() if line.strip().startswith("output tok/s"))
    assert "1.20" in throughput_row and "0.90" in throughput_row and "1.05" in throughput_row  # median of two
    assert "ahead" in throughput_row
    assert "0.50" in text  # served / offline: the rounds' median 105 against 210


def test_rounds_need_vllm_and_no_speculation_ab(tmp_path):
    from rich.console import Console

    from cluster.bench.served import measure_served

    script = tmp_path / "vllm_cpu.sh"
    script.write_text("#!/bin/sh\necho model-folder\n")
    script.chmod(0o755)
    for argv, wanted in ((["--rounds", "0"], "at least 1"), (["--rounds", "2", "--skip-vllm"], "--skip-vllm"),
                         (["--rounds", "2", "--speculation-ab", "1"], "--speculation-ab")):
        args = _args("--vllm-script", str(script), "--python-vllm", "/bin/true", "--vllm-dtype", "bfloat16", *argv)
        try:
            measure_served(args, Console(file=None))
        except ValueError as err:
            assert wanted in str(err)
        else:
            raise AssertionError(f"{argv} was taken")


def test_llamacpp_is_a_peer_of_its_own_beside_vllm():
    import io

    from rich.console import Console

    from cluster.bench.served import add_served_args
    from cluster.bench.served_report import print_served_report, server_ratios, server_rounds

    systems = {}
    for r, figures in enumerate([(100.0, 100.0, 50.0, 400.0), (90.0, 110.0, 60.0, 400.0)], start=1):
        tandem, llamacpp = _round(*figures)
        systems[f"tandem #{r}"], systems[f"llamacpp #{r}"] = tandem, llamacpp
        systems[f"vllm-all-cores #{r}"] = _round(*figures)[1] | {}
    assert server_rounds(systems, "llamacpp")[0] == ("tandem #1", ["llamacpp #1"])
    ratios = server_ratios(systems, "llamacpp")["random @ 2/s"]
    assert ratios["output_throughput"]["rounds"] == [2.0, 1.5] and ratios["mean_ttft_ms"]["ahead"]
    out = io.StringIO()
    print_served_report(Console(file=out, width=250), {"systems": systems, "offline": {}})
    assert "tandem and vllm" in out.getvalue() and "tandem and llamacpp" in out.getvalue()
    import argparse

    parser = argparse.ArgumentParser()
    add_served_args(parser)
    args = parser.parse_args(["--llamacpp", "--llamacpp-args=--spec-type ngram-mod"])
    assert args.llamacpp and args.llamacpp_args == "--spec-type ngram-mod"


def test_counters_are_read_from_the_servers_metrics(monkeypatch):
    from cluster.bench import server_readings as readings

    class Page:
        def __init__(self, text: str) -> None:
            self.text = text

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            pass

        def read(self) -> bytes:
            return self.text.encode()

    def page(preempted: float, drafts: float, drafted: float, accepted: float) -> str:
        return (f'# TYPE vllm:num_preemptions counter\nvllm:num_preemptions_total{{replica="a"}} {preempted}\n'
                'vllm:num_preemptions_total{replica="b"} 2.0\n'
                f'# TYPE vllm:spec_decode_num_drafts counter\nvllm:spec_decode_num_drafts_total {drafts}\n'
                f'# TYPE vllm:spec_decode_num_draft_tokens counter\nvllm:spec_decode_num_draft_tokens_total {drafted}\n'
                '# TYPE vllm:spec_decode_num_accepted_tokens counter\n'
                f'vllm:spec_decode_num_accepted_tokens_total {accepted}\n')

    monkeypatch.setattr(readings.urllib.request, "urlopen", lambda url, timeout: Page(page(3, 10, 40, 8)))
    before = readings.read_counters("http://h:1")
    assert before == {"num_preemptions": 5.0, "num_drafts": 10.0, "num_draft_tokens": 40.0,
                      "num_accepted_tokens": 8.0}
    monkeypatch.setattr(readings.urllib.request, "urlopen", lambda url, timeout: Page(page(4, 30, 120, 48)))
    figures = readings.counter_figures(before, readings.read_counters("http://h:1"))
    assert figures == {"num_preemptions": 1.0, "num_drafts": 20.0, "num_draft_tokens": 80.0,
                       "num_accepted_tokens": 40.0, "acceptance_rate": 0.5, "mean_acceptance_length": 3.0}
    monkeypatch.setattr(readings.urllib.request, "urlopen", lambda url, timeout: Page("# nothing\n"))
    fresh = readings.read_counters("http://h:1")
    assert fresh == {}  # a fresh server that has not published its counters yet
    assert readings.counter_figures(fresh, {"num_preemptions": 2.0}) == {"num_preemptions": 2.0}  # they start at 0
    assert readings.counter_figures({}, {}) == {}  # a server that publishes none: nothing made up

    def unreadable(url, timeout):
        raise OSError("connection refused")

    monkeypatch.setattr(readings.urllib.request, "urlopen", unreadable)
    assert readings.read_counters("http://h:1") is None
    assert readings.counter_figures(None, {"num_preemptions": 2.0}) == {}  # a total is not a cell's share
