"""The strategy advisor (``cpcompile.advisor.advise``) against hand-computed work and the ``auto`` rule."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cpcompile
from cpcompile.advisor import advise
from cpcompile.advisor.comm_model import choose_spec
from cpcompile.cost.comm import Heads
from cpcompile.cost.timing import decide, option_name, parse_topology
from tests.fixtures import cu_seqlens


def by_name(advice: advise.Advice) -> dict[str, advise.StrategyReport]:
    return {r.name: r for r in advice.reports}


def test_work_and_padding_by_hand():
    # one document of 16 tokens on 2 ranks: causal work of token i is i + 1 keys
    reports = by_name(advise.advise([cu_seqlens([16])], cp_size=2))
    # no_load_balance: rank 0 holds tokens 0-7 (1 + ... + 8 = 36 pairs), rank 1 tokens 8-15 (9 + ... + 16 = 100)
    assert reports["no_load_balance"].work_imbalance() == [pytest.approx(100 / 68)]
    # dual_chunk_swap: chunks 0 and 3 (10 + 58) against chunks 1 and 2 (26 + 42): even
    assert reports["dual_chunk_swap"].work_imbalance() == [pytest.approx(1.0)]
    # documents of 3 and 13 tokens: dual_chunk_swap pads each to a multiple of 2 cp = 4 (4 + 16 = 20 tokens)
    reports = by_name(advise.advise([cu_seqlens([3, 13])], cp_size=2))
    assert int(reports["dual_chunk_swap"].costs[0].tokens.sum()) == 20
    assert int(reports["no_load_balance"].costs[0].tokens.sum()) == 16


def test_recommendation_follows_the_cost_model():
    packs = [cu_seqlens([4096]), cu_seqlens([100, 3000, 996]), cu_seqlens([64] * 64)]
    advice = advise.advise(packs, cp_size=4)
    # per pack, the pick is what auto itself would choose
    assert advice.auto_picks == [advise.spec_name(cpcompile.cost.choose_strategy(p, cp_size=4)) for p in packs]
    totals = {r.name: sum(r.steps()) for r in advice.reports}
    per_pack_best = sum(min(steps) for steps in zip(*(r.steps() for r in advice.reports)))
    best_fixed = min(totals, key=totals.__getitem__)
    saves = per_pack_best < (1 - advise.AUTO_MARGIN) * totals[best_fixed]
    assert advice.recommended == ("auto" if saves else best_fixed)
    # a single long document: no_load_balance leaves the last rank all the work
    assert advise.advise([cu_seqlens([4096])], cp_size=4).recommended != "no_load_balance"
    table = advise.format_table(advice)
    assert f"recommended: {advice.recommended}" in table
    assert all(name in table for name in totals)


def test_packs_are_cut_at_the_pack_size(tmp_path):
    lengths = [5, 700, 33, 12000]
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps(lengths))
    draw = advise.length_sampler(path, torch.Generator().manual_seed(0))
    for _ in range(5):
        pack = advise.cut_pack(draw, 4096)
        sizes = torch.diff(pack).tolist()
        assert pack.dtype == torch.int32 and int(pack[-1]) == 4096
        assert all(n in lengths for n in sizes[:-1]) and 0 < sizes[-1] <= max(lengths)


def test_cdf_lengths_stay_in_their_bins(tmp_path):
    path = tmp_path / "cdf.csv"
    path.write_text("upper_bound_tokens,cumulative_percent\n10,50\n100,100\n")
    lengths = advise.length_sampler(path, torch.Generator().manual_seed(0))(4000)
    assert int(lengths.min()) >= 1 and int(lengths.max()) <= 100
    assert 0.45 < float((lengths <= 10).double().mean()) < 0.55  # half the documents in the first bin


def test_bad_length_file_names_the_option(tmp_path):
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps({"not": "a list"}))
    with pytest.raises(ValueError, match="--doclens .*JSON list of token counts"):
        advise.length_sampler(path, torch.Generator())


@pytest.mark.parametrize(
    "name, text, expected",
    [
        ("lengths.json", '{"a": 1', "expected a JSON list of token counts"),
        ("lengths.json", "", "the file is empty"),
        ("lengths.json", "[5, -3, 7]", "token counts must be ints >= 1, got -3"),
        ("lengths.json", "[1.5]", "token counts must be ints >= 1, got 1.5"),
        ("lengths.json", "[]", "got an empty list"),
        ("lengths.txt", "12\nx\n", "invalid literal"),
        ("cdf.csv", "tokens,percent\n10,100\n", "columns upper_bound_tokens,cumulative_percent, got tokens,percent"),
        ("cdf.csv", "upper_bound_tokens,cumulative_percent\n", "at least one row"),
        ("cdf.csv", "upper_bound_tokens,cumulative_percent\n10,50\n20\n", "line 3 needs an int"),
        ("cdf.csv", "upper_bound_tokens,cumulative_percent\n100,50\n50,100\n", "must rise"),
        ("cdf.csv", "upper_bound_tokens,cumulative_percent\n10,60\n20,40\n", "must not fall"),
        ("missing.json", None, "cannot read it as text"),
    ],
)
def test_bad_length_files_are_one_line_errors(tmp_path, capsys, name, text, expected):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        advise.main(["--doclens", str(path), "--pack", "1024", "--cp", "2", "--packs", "1"])
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""  # nothing sampled or printed before the error
    message = err.strip().splitlines()[-1]
    assert message.startswith(f"python -m cpcompile.advisor: error: --doclens {path}: ") and expected in message


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--cp", "0"], "argument --cp: must be an int >= 1, got '0'"),
        (["--cp", "-4"], "argument --cp: must be an int >= 1, got '-4'"),
        (["--packs", "0"], "argument --packs: must be an int >= 1, got '0'"),
        (["--pack", "4", "--cp", "8"], "--pack 4 must be at least --cp 8 (one token per rank)"),
        (["--plot", "no/such/dir/advice.png"], "--plot no/such/dir/advice.png: directory no/such/dir does not exist"),
        (["--heads", "32/6"], "argument --heads: must be Q/KV, positive ints with Q a multiple of KV, got '32/6'"),
        (["--heads", "32"], "argument --heads: must be Q/KV, positive ints with Q a multiple of KV, got '32'"),
        (
            ["--topology", "dgx"],
            "argument --topology: topology must start with one of ['h200', 'h200-200g', 'h200-4'], got 'dgx' in 'dgx'",
        ),
        (["--topology", "h200,inter_gbps=0"], "argument --topology: Topology.inter_gbps must be a number > 0, got 0.0"),
    ],
)
def test_bad_arguments_are_one_line_errors(capsys, argv, expected):
    with pytest.raises(SystemExit) as exit_info:
        advise.main(argv)
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip().splitlines()[-1] == f"python -m cpcompile.advisor: error: {expected}"


def test_head_parallel_options_stand_beside_the_strategies(capsys):
    """The second table: every u > 1 dividing cp and the query heads, pure (u = cp) on no_load_balance,
    with its per-rank work and bytes, and choose_spec's picks."""
    advice = advise.main(["--pack", "8192", "--cp", "4", "--packs", "2", "--heads", "8/2", "--head-dim", "16"])
    out = capsys.readouterr().out
    names = [o.name for o in advice.heads.options]
    assert names[:4] == [r.name for r in advice.reports]
    assert names[4:] == [f"{r.name} u=2" for r in advice.reports] + ["no_load_balance u=4"]
    for o in advice.heads.options:
        row = next(line for line in out.splitlines() if line.startswith(f"{o.name} ") and o.steps[0].bytes.path in line)
        assert row.split()[len(o.name.split())] == str(8 // o.spec.head_parallel)  # heads per rank
    pure = advice.heads.options[-1]
    assert all(float(s.costs.pairs.max()) == float(s.costs.pairs.min()) for s in pure.steps)  # even work
    packs = advice.packs
    assert advice.heads.picks == [advise.spec_name(choose_spec(cu, cp_size=4, heads=Heads(8, 2, 16))) for cu in packs]
    assert f"with communication: {advice.heads.recommended}" in out


def test_topology_shows_the_predicted_layer_of_every_option(capsys):
    """The third table: every option decide weighs, its predicted layer, and decide's pick per pack."""
    argv = ["--pack", "8192", "--cp", "4", "--packs", "2", "--heads", "8/2", "--head-dim", "64"]
    advice = advise.main([*argv, "--topology", "h200,gpus_per_node=2"])
    out = capsys.readouterr().out
    topology, heads = parse_topology("h200,gpus_per_node=2"), Heads(8, 2, 64)
    assert "2 node(s) of 2 GPUs, NVLink 294 GB/s, across nodes 50 GB/s per GPU" in out
    decisions = [decide(cu, cp_size=4, heads=heads, topology=topology) for cu in advice.packs]
    assert advice.topology.picks == [option_name(d.spec, 4) for d in decisions]
    table = out.split("predicted layer over the topology")[1].split("\n\n")[1].splitlines()[1:]
    assert [row[:30].strip() for row in table] == [option_name(o, 4) for o in decisions[0].options]
    for row, i in zip(table, range(len(table))):
        as_run = sum(d.times[i].as_run for d in decisions) / 2 / 1e3
        assert float(row[30:].split()[0]) == pytest.approx(as_run, abs=0.006)  # printed to 0.01 ms
        assert int(row.split()[-1]) == advice.topology.picks.count(row[:30].strip())
    assert f"over this topology: {advice.topology.recommended} (lowest predicted layer over 2 packs)" in out


def test_plot_path_is_checked_before_work(tmp_path):
    pytest.importorskip("matplotlib", reason='needs the advise extra: pip install "cpcompile[advise]"')
    assert advise.plot_path_error(tmp_path) == "is a directory"
    assert advise.plot_path_error(tmp_path / "advice.foo").startswith("needs a suffix matplotlib writes (")
    assert advise.plot_path_error(tmp_path / "advice.png") is None


def test_builtin_mix_is_many_short_documents_and_a_long_tail():
    mix = advise.BUILTIN_MIX
    lengths = mix.sampler(torch.Generator().manual_seed(0))(20000)
    assert lengths.dtype == torch.int64 and int(lengths.min()) >= 1 and int(lengths.max()) <= mix.long_max
    long = lengths >= mix.long_min
    # the long share, plus the log-normal's own tail past long_min (1% at sigma 1.2)
    assert mix.long_share < float(long.double().mean()) < mix.long_share + 0.015
    assert 0.9 * mix.median < float(lengths.double().median()) < 1.1 * mix.median  # the long ones barely move it
    assert int(lengths[long].sum()) > int(lengths[~long].sum())  # the few long documents hold most tokens


def test_without_doclens_the_builtin_mix_is_sampled(capsys):
    advice = advise.main(["--pack", "8192", "--cp", "4", "--packs", "2"])
    out = capsys.readouterr().out
    assert out.startswith("document lengths: the built-in synthetic mix (no --doclens): 98% of documents")
    assert f"recommended: {advice.recommended}" in out


def test_runs_from_a_fresh_checkout(tmp_path):
    # the package alone, nothing beside it (no ../shared data): the README's command must still run
    checkout = tmp_path / "cpcompile-checkout"
    shutil.copytree(Path(advise.__file__).parent, checkout / "cpcompile", ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run(
        [sys.executable, "-m", "cpcompile.advisor", "--pack", "8192", "--cp", "4", "--packs", "2"],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "built-in synthetic mix" in run.stdout and "recommended:" in run.stdout
    assert "Warning" not in run.stderr


def test_command_line_without_matplotlib(tmp_path, monkeypatch, capsys):
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(["300", "1200", "50", "5000"]))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    advice = advise.main(["--doclens", str(path), "--pack", "8192", "--cp", "4", "--packs", "2", "--plot", "x.png"])
    out, err = capsys.readouterr()
    assert f"recommended: {advice.recommended}" in out
    assert 'pip install "cpcompile[advise]"' in err


def test_plot_writes_a_png(tmp_path, capsys):
    image = pytest.importorskip("matplotlib.image", reason='needs the advise extra: pip install "cpcompile[advise]"')
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps([300, 1200, 50, 5000]))
    png = tmp_path / "advice.png"
    advise.main(["--doclens", str(path), "--pack", "8192", "--cp", "4", "--packs", "2", "--plot", str(png)])
    assert f"wrote {png}: per-rank bars of pack 1 of 2 (the table averages all 2)" in capsys.readouterr().out
    height, width, _ = image.imread(png).shape
    assert width > 1000 and height > 500  # four strategy panels side by side
