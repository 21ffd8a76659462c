# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Findings: the three papers' claims, re-measured with kvscope
#
# Every number and figure here is recomputed from the committed tables under `results/` (no model is loaded): the
# study of Qwen2.5-Coder-0.5B-Instruct on GSM8K (`python -m study`; again under the forced-answer labels, and on
# Qwen2.5-Coder-1.5B at two budgets), its extra protection sweep, the geometry survey
# of the four installed models, the planted-fact and passcode probes, a RULER sweep of SmolLM2 under compression,
# and the two memory benchmarks (prefill memory of scoring, throughput at equal KV memory). `results/README.md` holds
# the same findings table with the paper's values and a verdict per row; each row names the folder that backs it.
#
# Verdicts: a claim about a correlation or a difference is *reproduced* when its 95% interval excludes zero in the
# paper's direction, *not reproduced* when it excludes zero the other way (or the measured value contradicts the
# paper's), and *inconclusive* when the interval spans zero.

# %% tags=["parameters"]
results_dir = "../results"  # the committed findings (the notebook runs in notebooks/)
study = "qwen2.5-0.5b-gsm8k"  # the study folder under results_dir
window = 64  # the rolling window the study used (its signals' suffix: mean64, z64)
out_dir = "runs/notebooks/findings"

# %%
import json
import math
from pathlib import Path

import pandas as pd
from IPython.display import Markdown, display

from figures.accuracy_budget import plot_accuracy_vs_budget
from figures.forest import plot_forest
from figures.head_sets import plot_head_set_retrieval
from figures.layer_rho import from_validation_table, plot_layer_rho
from figures.notebook import prepare, show
from figures.sink_ratio import plot_sink_vs_ratio
from study.report import distinct_scorers

root = Path(results_dir)
study_dir = root / study
out = prepare(out_dir)
fig_dir = out / "figures"
findings = []


def interval(lo, hi) -> str:
    return "–" if lo is None or not (math.isfinite(lo) and math.isfinite(hi)) else f"[{lo:+.3f}, {hi:+.3f}]"


def verdict(lo, hi, direction: int) -> str:
    """`direction` +1: the paper claims a positive quantity; -1: negative."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "inconclusive"
    if lo > 0 or hi < 0:
        return "reproduced" if (lo > 0) == (direction > 0) else "not reproduced"
    return "inconclusive"


def add(claim: str, paper: str, value: str, ci: str, n, result: str, source: str) -> None:
    findings.append({"claim": claim, "paper": paper, "kvscope": value, "95% CI": ci, "n": n, "verdict": result,
                     "source": source})


# %% [markdown]
# ## EpiKV: the layer anatomy of g_l against occlusion labels

# %%
layers = pd.read_csv(study_dir / "layers.csv")
g = layers[layers["family"] == "hidden_diff"].copy()
g["layer"] = g["layer"].astype(int)
show(plot_layer_rho(from_validation_table(g), band_signal=f"hidden_diff.mean{window}"), fig_dir, "layer_rho")
smooth = g[g["transform"] == f"mean{window}"].set_index("layer").sort_index()
positive = smooth[smooth["within_lo"] > 0].index.tolist()
negative = smooth[smooth["within_hi"] < 0].index.tolist()
top, bottom = smooth["within_rho"].idxmax(), smooth["within_rho"].idxmin()
n_traces = int(smooth["within_n_eff"].max())
display(Markdown(f"Layers whose rolling-{window} g_l has a 95% interval above zero: {positive or 'none'}; below "
                 f"zero: {negative or 'none'} (of {len(smooth)} layers, n_eff = {n_traces} traces)."))
z = g[g["transform"] == f"z{window}"].set_index("layer").sort_index()
strongest_z = z["within_rho"].abs().idxmax()
anatomy = (f"positive: {positive or 'none'} (peak layer {top} {smooth.loc[top, 'within_rho']:+.3f}); negative: "
           f"{negative or 'none'} (peak layer {bottom} {smooth.loc[bottom, 'within_rho']:+.3f}); z-scored: best "
           f"|rho| {abs(z.loc[strongest_z, 'within_rho']):.3f} (layer {strongest_z})")
two_bands = bool(positive) and bool(negative) and max(positive) < min(negative)
add("two-band anatomy of rolling-mean g_l: a positive mid band above a negative upper-mid band",
    "band A layers 7–13 rho > 0, band B 18–25 rho < 0 (of 32)", anatomy,
    f"peak + {interval(smooth.loc[top, 'within_lo'], smooth.loc[top, 'within_hi'])}, peak − "
    f"{interval(smooth.loc[bottom, 'within_lo'], smooth.loc[bottom, 'within_hi'])}", n_traces,
    "reproduced" if two_bands else "not reproduced", study)

# %% [markdown]
# The rolling-64 window against the raw signal, at the layer where the smoothed signal is strongest; and the causal
# z-score against the positional trend (within-trace rho of the signal with position, raw rolling mean vs z-score).

# %%
raw = g[g["transform"] == "raw"].set_index("layer").sort_index()
peak = (smooth["within_rho"].abs()).idxmax()
gain = abs(smooth.loc[peak, "within_rho"]) / abs(raw.loc[peak, "within_rho"]) - 1
add("rolling-64 mean improves |rho| over raw g_l", "+32–57%",
    f"{100 * gain:+.0f}% at layer {peak} (|rho| {abs(raw.loc[peak, 'within_rho']):.3f} -> "
    f"{abs(smooth.loc[peak, 'within_rho']):.3f})", "–", n_traces,
    "reproduced" if gain > 0 else "not reproduced", study)
positional = pd.read_csv(study_dir / "positional.csv").set_index("layer")
display(positional[["raw_position_rho", "detrended_position_rho", "raw_label_rho", "detrended_label_rho"]].round(3))
row = positional.loc[positional["raw_position_rho"].abs().idxmax()]
add("the causal z-score removes the positional trend", "raw tracks position; z does not",
    f"|position rho| {abs(row['raw_position_rho']):.3f} -> {abs(row['detrended_position_rho']):.3f} "
    f"(layer {row.name})", interval(row["detrended_position_lo"], row["detrended_position_hi"]) + " (z)", n_traces,
    "reproduced" if abs(row["detrended_position_rho"]) < abs(row["raw_position_rho"]) and
    verdict(row["detrended_position_lo"], row["detrended_position_hi"], +1) == "inconclusive" else "not reproduced",
    study)

# %% [markdown]
# ## Scorers ranked against the labels (the replayed scores of each policy and the per-layer signals)

# %%
ranking = pd.read_csv(study_dir / "ranking.csv")
shown = pd.DataFrame(distinct_scorers(ranking.to_dict("records"))[:15])  # each scorer at its best layer and head
shown["policy"] = shown["policy"].fillna("(no policy)")
show(plot_forest(shown, label="signal", value="within_rho", low="within_lo", high="within_hi", group="policy",
                 xlabel="within-trace Spearman ρ with occlusion labels"), fig_dir, "scorer_ranking")


def deployed(policy: str, table: pd.DataFrame = ranking) -> pd.Series:
    """The row of a policy's own keep score (its replayed aggregate over layers and heads) in a ranking table."""
    return table[table["signal"] == f"{policy}.agg.raw"].iloc[0]


attention = deployed("h2o")
band_rows = g[(g["transform"] == f"mean{window}") & g["layer"].isin(positive + negative)]
weakest_band = band_rows["within_rho"].abs().min() if not band_rows.empty else float("nan")
add("attention received (H2O's score) is the weakest signal", "|rho| <= 0.09, below every band layer",
    f"h2o {attention['within_rho']:+.3f}; weakest band layer |rho| {weakest_band:.3f}",
    interval(attention["within_lo"], attention["within_hi"]), int(attention["within_n_eff"]),
    "reproduced" if attention["within_lo"] <= 0 <= attention["within_hi"] and abs(attention["within_rho"]) <
    weakest_band else "not reproduced", study)
value, key = deployed("valuediff"), deployed("keydiff")
add("value geometry ranks tokens better than key geometry", "ValueDiff > KeyDiff outside quadrant III",
    f"valuediff {value['within_rho']:+.3f} vs keydiff {key['within_rho']:+.3f} (position rho "
    f"{value['position_rho']:+.2f} vs {key['position_rho']:+.2f})",
    f"{interval(value['within_lo'], value['within_hi'])} vs {interval(key['within_lo'], key['within_hi'])}",
    int(value["within_n_eff"]),
    "reproduced" if value["within_lo"] > key["within_hi"] else
    "not reproduced" if key["within_lo"] > value["within_hi"] else "inconclusive", study)
recency = deployed("recency")
display(Markdown(f"The labels themselves track position: recency's rho is {recency['within_rho']:+.3f} "
                 f"{interval(recency['within_lo'], recency['within_hi'])}."))

# %% [markdown]
# ## Eviction at equal peak cache: every configuration against random with the prompt kept

# %%
accuracy = pd.read_csv(study_dir / "accuracy.csv")
show(plot_accuracy_vs_budget(accuracy.assign(policy=accuracy["config"])), fig_dir, "accuracy_budget")
def read_comparisons(*tables: Path) -> pd.DataFrame:
    """The rows of `validation.compare` tables that compared (a refused pair carries its reason in `error`)."""
    rows = pd.concat([pd.read_csv(table) for table in tables])
    return rows[rows["error"].isna()].copy()


def display_comparisons(rows: pd.DataFrame) -> None:
    display(rows[["config", "budget_a", "n_problems", "accuracy_a", "accuracy_b", "difference", "ci_lo", "ci_hi",
                  "bootstrap_p", "sign_p_value"]].round(3))


compared = read_comparisons(study_dir / "compare.csv")
compared["label"] = compared["config"] + " @ " + compared["budget_a"].astype(str)
show(plot_forest(compared, value="difference", low="ci_lo", high="ci_hi", xlabel="accuracy − random (paired)"),
     fig_dir, "difference_vs_random")
display_comparisons(compared)


def add_best_against_random(compared: pd.DataFrame, source: str, claim: str) -> None:
    """The R1 row of one study's comparisons with random: the scored policy (neither full nor recency) that gains
    most on random, and whether its interval still reaches zero."""
    scored = compared[~compared["policy_a"].isin(["full", "recency"])]
    if scored.empty:
        return
    top_row = scored.loc[scored["difference"].idxmax()]
    add(claim, "within a few points, not significant",
        f"best scored {top_row['config']}: {100 * top_row['difference']:+.1f} points vs random",
        interval(top_row["ci_lo"], top_row["ci_hi"]), int(top_row["n_problems"]),
        "reproduced" if top_row["ci_lo"] <= 0 else "not reproduced", source)


add_best_against_random(compared, study, "random (prompt kept) matches the best scored policy")

protection = study_dir / "protection" / "comparison.csv"
if protection.is_file():
    sweep = pd.read_csv(protection)
    display(sweep[["policy_a", "budget_a", "n_problems", "accuracy_a", "accuracy_b", "difference", "ci_lo",
                   "ci_hi", "bootstrap_p", "sign_n_discordant"]].round(3))
    claims = {"random_unprotected": ("dropping the prompt rule collapses random", "0.46 -> 0.87 with the rule", -1),
              "random_shared": ("a shared draw scores as the per-head draw", "0.871 vs 0.874", 0)}
    for policy, (claim, paper, direction) in claims.items():
        rows = sweep[sweep["policy_a"] == policy]
        if rows.empty:
            continue
        r = rows.iloc[0]
        # With fewer than 6 problems answered differently, no exact sign test can reach p < 0.05: the two
        # policies barely diverged, so the run cannot speak to the claim either way.
        if r["sign_n_discordant"] < 6:
            result = f"inconclusive ({int(r['sign_n_discordant'])} of {int(r['n_problems'])} problems differ)"
        elif direction:
            result = verdict(r["ci_lo"], r["ci_hi"], direction)
        else:
            result = "reproduced" if r["ci_lo"] <= 0 <= r["ci_hi"] else "not reproduced"
        add(claim, paper, f"{100 * r['difference']:+.1f} points vs random ({r['accuracy_a']:.2f} vs "
            f"{r['accuracy_b']:.2f})", interval(r["ci_lo"], r["ci_hi"]), int(r["n_problems"]), result,
            f"{study}/protection")

# %% [markdown]
# ## ValueDiff: geometry of the four installed models against the paper's families

# %%
survey = pd.concat([pd.read_csv(path) for path in sorted((root / "geometry").glob("*/model.csv"))],
                   ignore_index=True)
survey = survey[survey["scope"] == "all"].reset_index(drop=True)  # Gemma3 adds sliding / global rows
display(survey[["model", "sink_rate", "sigma_k", "sigma_v", "sigma_ratio", "alpha_bos", "bos_cos", "jaccard"]]
        .round(3))
show(plot_sink_vs_ratio(survey), fig_dir, "sink_vs_ratio")
families = {"smollm2": ("Llama family: sigma_V/sigma_K 0.33–0.40, sink rate 0.80–0.84", lambda r: r < 0.5),
            "gemma3": ("Gemma3-4B: sigma_V/sigma_K 0.67, sink rate 0.27", lambda r: 0.5 <= r < 1.0),
            "qwen2.5": ("Qwen2.5-3B/7B: sigma_V/sigma_K 1.19–1.34, sink rate 0.39–0.45", lambda r: r > 1.0)}
for _, r in survey.iterrows():
    family = next(f for f in families if str(r["model"]).startswith(f))
    paper, expected = families[family]
    add(f"sigma_V/sigma_K regime of {r['model']}", paper,
        f"sigma_V/sigma_K {r['sigma_ratio']:.2f}, sink rate {r['sink_rate']:.2f}, alpha_BOS {r['alpha_bos']:.2f}, "
        f"BOS cos {r['bos_cos']:+.2f}", "–", "calibration prompts (config.json)",
        "reproduced" if expected(r["sigma_ratio"]) else "not reproduced", f"geometry/{r['model']}")
# ValueDiff's score and the sink: how often it ranks the first token among the top quarter of the context, per
# (layer, KV head) and sequence (geometry.stats.first_token_kept), against the sink rate
first = survey.dropna(subset=["valuediff_first_k25"]) if "valuediff_first_k25" in survey else survey.iloc[:0]
if not first.empty:
    display(first[["model", "sink_rate", "valuediff_first_k25", "valuediff_first_k50"]].round(3))
    add("ValueDiff keeps the first token on a model with attention sinks (its 88% of dense on Llama-3.1-8B, sink "
        "rate 0.80)", "not measured in the paper",
        "; ".join(f"{r['model']}: sink rate {r['sink_rate']:.2f}, first token kept at K = T/4 in "
                  f"{100 * r['valuediff_first_k25']:.0f}% of (layer, KV head)s, at T/2 in "
                  f"{100 * r['valuediff_first_k50']:.0f}%" for _, r in first.iterrows()),
        "–", "calibration prompts (config.json)",
        "measured: where ValueDiff keeps the sink in few (layer, KV head)s, as on every model here, it collapses at "
        "a quarter of the context (L1, L2); the paper's 88% on a sink rate of 0.80 needs the 8B's sink values far "
        "from the value mean", "geometry")
jaccard = survey["jaccard"]
contexts = {json.loads(path.read_text())["ctx"] for path in (root / "geometry").glob("*/config.json")}
add("top-256 attention sets are unstable across queries", "Jaccard ≈ 0.4 at 2048-token contexts",
    f"{jaccard.min():.2f}–{jaccard.max():.2f} across the four models at {', '.join(map(str, sorted(contexts)))} "
    "tokens", "–", len(survey),
    "inconclusive (shorter context: the top 256 are a larger share)" if max(contexts) < 2048 else
    "reproduced" if jaccard.max() < 0.6 else "not reproduced", "geometry")

# %% [markdown]
# ## Random Attention: which heads must hold a planted fact, and a passcode stated once

# %%
planted = pd.read_csv(root / "planted-fact" / "summary.csv")
show(plot_head_set_retrieval(planted), fig_dir, "head_set_retrieval")
display(planted.round(3))
heads = planted.dropna(subset=["n_heads"])
by_heads = heads.groupby("n_heads")["retrieval"].mean()
partial = by_heads[(by_heads.index > 0) & (by_heads.index < by_heads.index.max())]
add("retrieval grows super-additively with the heads holding the fact", "1 head 1–3%, 2: 16–60%, 3: 83%, all 99%",
    ", ".join(f"{int(k)} heads: {100 * v:.0f}%" for k, v in by_heads.items()), "per head set in summary.csv",
    int(planted["n"].min()), "not reproduced (all or nothing)" if partial.max() == 0 else
    "reproduced" if by_heads.is_monotonic_increasing else "not reproduced", "planted-fact")
passcode = pd.read_csv(root / "passcode" / "summary.csv")
display(passcode.round(3))
random_row = passcode[passcode["condition"].str.startswith("random")].iloc[0]
add("random never recovers a passcode stated once",
    "0% (R-KV 84% in Random Attention's port at λ = 0.5, VaSE 34%, SnapKV ≈ 0)",
    ", ".join(f"{c}: {100 * v:.0f}%" for c, v in zip(passcode["condition"], passcode["retrieval"])),
    interval(random_row["retrieval_lo"], random_row["retrieval_hi"]) + " (random)", int(random_row["n"]),
    "reproduced" if random_row["retrieval_hi"] < 0.2 else "not reproduced", "passcode")

# %% [markdown]
# ## Long context: RULER accuracy against compression, and the memory eviction frees

# %%
sink_rates = survey.set_index("model")["sink_rate"]
for ruler_dir in sorted(root.glob("ruler-*")):
    ruler = pd.read_csv(ruler_dir / "summary.csv")
    identity = json.loads((ruler_dir / "config.json").read_text())["identity"]
    # the generated dataset with its length, e.g. "generated:ruler_niah_single@2048 seed=0 ..."
    context = identity["data_source"].split()[0].split(":")[1]
    model = identity["model"]
    dense = ruler.loc[ruler["policy"] == "full", "accuracy"].iloc[0]
    evicted = ruler[ruler["policy"] != "full"].copy()
    evicted["retention"] = evicted["accuracy"] / dense
    # a cell run outside its policy's protocol (EpiKV and random with the prompt evicted) is no score of the method
    outside = set(evicted.loc[evicted["outside_protocol"].fillna("") != "", "policy"])

    def named(policy: str, outside: set[str] = outside) -> str:
        return f"{policy} (outside its protocol)" if policy in outside else policy

    show(plot_accuracy_vs_budget(ruler), fig_dir, f"accuracy_budget_{ruler_dir.name}")
    display(Markdown(f"{model} on {context}, dense accuracy {dense:.2f}; retention (accuracy / dense) per policy "
                     "and K:"))
    display(evicted.pivot(index="policy", columns="budget", values="retention").round(2))
    versus = pd.read_csv(ruler_dir / "comparison.csv")
    quarter = int(context.rpartition("@")[2]) // 4  # ValueDiff's tight budget: 2k of an 8k context
    at_quarter = evicted[evicted["budget"] == quarter].set_index("policy")
    valuediff = at_quarter.loc["valuediff"]
    better = versus[(versus["budget_a"] == quarter) & (versus["policy_a"] != "valuediff") & (versus["ci_lo"] > 0)]
    value = (f"{model}, {context}, K = {quarter}: ValueDiff {100 * valuediff['retention']:.0f}% of dense; "
             + ", ".join(f"{named(p)} {100 * r:.0f}%" for p, r in at_quarter["retention"].drop("valuediff").items()))
    at_half = evicted[evicted["budget"] == 2 * quarter].set_index("policy")["retention"]
    if not at_half.empty:
        runner_up = at_half.drop(["valuediff", *outside], errors="ignore").idxmax()
        value += (f"; K = {2 * quarter}: ValueDiff {100 * at_half['valuediff']:.0f}%, best other {runner_up} "
                  f"{100 * at_half[runner_up]:.0f}%")
    sinks_kept = ruler_dir / "study" / "accuracy.csv"
    if sinks_kept.is_file():  # the same problems with every policy keeping the first 4 tokens (a study run)
        sinks_kept = pd.read_csv(sinks_kept)
        display(sinks_kept.pivot(index="config", columns="budget", values="accuracy").round(3))
        value += "; ValueDiff with the first 4 tokens kept: " + ", ".join(
            f"{100 * r['accuracy'] / dense:.0f}% at K = {int(r['budget'])}"
            for _, r in sinks_kept[sinks_kept["config"] == "valuediff"].iterrows())
    add("on RULER at a quarter of the context ValueDiff keeps most of dense accuracy, best or tied-best (claimed for "
        f"sink-suppressed models; {model}'s sink rate is {sink_rates.get(model, float('nan')):.2f})",
        "88–99% of dense at 2k of 8k tokens on sink-suppressed models, best on 6 of 7", value,
        interval(valuediff["ci_lo"], valuediff["ci_hi"]) + " (ValueDiff accuracy)", int(valuediff["problems"]),
        "reproduced" if valuediff["retention"] >= 0.88 and better.empty else
        f"not reproduced ({', '.join(better['policy_a'])} significantly better)" if not better.empty else
        "not reproduced", ruler_dir.name)

prefill = pd.read_csv(root / "prefill-memory" / "prefill_memory.csv")
deep = prefill[prefill["layers"] == prefill["layers"].max()]
eager = deep[deep["kernel"].str.startswith("eager") & ~deep["oom"]].set_index("ctx")["peak_mem_mb"] / 1024
fused = deep[deep["kernel"] == "sdpa+valuediff"].set_index("ctx")["peak_mem_mb"] / 1024
add("attention-requiring scoring hits a prefill memory wall that fused kernels avoid",
    "eager + output_attentions: 52 GB at 4096 tokens, out of memory at 8192 (80 GB); FlashAttention to 65,536",
    f"eager {eager.max():.1f} GiB at {eager.idxmax()} tokens (32 layers, from 2 measured); SDPA + ValueDiff "
    f"{fused.loc[eager.idxmax()]:.1f} GiB there and {fused.max():.1f} GiB at {fused.idxmax()}", "–",
    "deterministic (allocator events)",
    "reproduced" if eager.max() > 2 * fused.loc[eager.idxmax()] else "not reproduced", "prefill-memory")

equal = pd.read_csv(root / "equal-memory" / "equal_memory.csv").set_index("policy")
display(equal[["fa", "prompt", "seq_mb", "fits", "batch", "kv_mb", "tok_s", "ratio"]].round(2))
evicting = equal.drop("full")
add("at equal KV memory every evictor serves several times full attention's throughput, through a larger batch",
    "6–10x (Qwen3-4B, batch 28 -> 186–200)",
    f"batch {int(equal.loc['full', 'batch'])} -> {int(evicting['batch'].min())}–{int(evicting['batch'].max())}; "
    + ", ".join(f"{p} {r:.1f}x" for p, r in evicting["ratio"].items()), "– (one run)", "1 GiB, 4,096 tokens",
    "reproduced" if evicting["ratio"].min() >= 2 else "not reproduced", "equal-memory")

# %% [markdown]
# ## The labeller against known answers
#
# The constructed known-answer traces of the earlier demo (`results/known-facts-smollm2/`, the needed note last): the
# windows that flipped, by whether they overlap the needed code, a decoy's or only filler, and each scorer's AUC for
# ranking the needed code above a decoy's code and above filler.

# %%
known_dir = root / "known-facts-smollm2"
known = json.loads(next((known_dir / "stages").glob("known-*/stage.json")).read_text())["outputs"]
labels = known["labels"]
display(pd.DataFrame([{"class": c, "windows": labels[f"{c}_windows"], "flipped": labels[f"{c}_flipped"]}
                      for c in ("planted", "key", "decoy", "filler", "flush")]))
auc = pd.DataFrame(known["auc"]).set_index("scorer")[["auc_decoy", "auc_filler"]]
display(auc.round(3))
evicted = pd.read_csv(known_dir / "compare.csv").set_index("config")
finding = evicted.loc[known["finding"]]
add("counterfactual occlusion labels mark the tokens an answer depends on (checked on known answers)", "–",
    f"{labels['planted_flipped']}/{labels['planted_windows']} needed-code windows flipped, "
    f"{labels['decoy_flipped']}/{labels['decoy_windows']} decoy, {labels['filler_flipped']}/{labels['filler_windows']} "
    f"filler; {known['finding']} (best lower AUC) {finding['accuracy_a']:.0%} vs random {finding['accuracy_b']:.0%}",
    f"recall [{labels['recall_lo']:.2f}, {labels['recall_hi']:.2f}], precision [{labels['precision_lo']:.2f}, "
    f"{labels['precision_hi']:.2f}]", f"{labels['traces']} traces",
    "the labels find the planted facts" if labels["recall_lo"] > 0.5 and labels["precision_lo"] > 0.5 else
    "inconclusive", known_dir.name)

# %% [markdown]
# ## The Qwen study's labels under the forced-answer protocol
#
# The same 40 traces relabelled with the trace's own answer cue after every occluded context
# (`results/qwen2.5-0.5b-gsm8k-forced/`): each window's outcome, where in the reasoning span the windows that change
# the answer fall (fifths of the span by the window's start; the window ending at the answer boundary on its own), and
# Cohen's kappa per position between the space filler and deletion on the traces both labelled, recomputed here from
# the label files alone.

# %%
forced_dir = root / "qwen2.5-0.5b-gsm8k-forced" / "stages"


def read_labels(path: Path) -> dict:
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines()) if r.get("status", "labelled") ==
            "labelled"}


def label_places(records) -> pd.DataFrame:
    """Window outcomes by where the window lies: fifths of the reasoning span by its start, the window ending at the
    answer boundary on its own."""
    places = ["first fifth", "second fifth", "third fifth", "fourth fifth", "last fifth", "at the answer boundary"]
    counts = pd.DataFrame(0, index=places, columns=["same", "different", "no_answer", "degenerate"])
    for record in records:
        start, end = record["reasoning_start"], record["answer_start"]
        for w in record["windows"]:
            room = end - start - (w["end"] - w["start"])
            fifth = min(4, int(5 * (w["start"] - start) / room)) if room > 0 else 0
            counts.loc[places[5] if w["end"] == end else places[fifth], w["outcome"]] += 1
    return counts


def where_summary(counts: pd.DataFrame) -> str:
    """How many windows change the answer and where, from `label_places`'s counts (the findings table's words)."""
    changed = counts["different"] + counts["no_answer"] + counts["degenerate"]
    return (f"{int(changed.sum())} of {int(counts.values.sum())} windows change the answer, "
            f"{int(counts['no_answer'].sum())} without an answer; {int(changed.iloc[4:].sum())} in the last fifth or "
            "at the answer boundary")


space = read_labels(next(forced_dir.glob("labels-*/labels.jsonl")))
deletion = read_labels(next(forced_dir.glob("agreement-*/delete/labels.jsonl")))
where = label_places(space.values())
display(where)


def reasoning_labels(record: dict) -> dict:
    """Position -> label inside the reasoning span (prompt positions are 1 by construction, the answer unlabelled)."""
    span = range(record["reasoning_start"], record["answer_start"])
    return {pos: label for pos, label in zip(record["positions"], record["labels"], strict=True)
            if pos in span and label is not None}


def position_kappa(first: dict, second: dict) -> tuple[float, int]:
    """Cohen's kappa per reasoning position between two label sets (id -> record), over the traces both labelled;
    returns it with that number of traces."""
    shared = sorted(set(first) & set(second))
    pairs = []
    for i in shared:
        a, b = reasoning_labels(first[i]), reasoning_labels(second[i])
        pairs += [(a[pos], b[pos]) for pos in sorted(a.keys() & b.keys())]
    observed = sum(a == b for a, b in pairs) / len(pairs)
    p_a, p_b = (sum(x[k] for x in pairs) / len(pairs) for k in (0, 1))
    expected = p_a * p_b + (1 - p_a) * (1 - p_b)
    return (observed - expected) / (1 - expected), len(shared)


kappa, agreement_traces = position_kappa(space, deletion)
changed = where["different"] + where["no_answer"] + where["degenerate"]
display(Markdown(f"{len(space)} traces, {int(where.values.sum())} windows, {int(changed.sum())} change the answer "
                 f"({int(where['no_answer'].sum())} without an answer); in the first four fifths: "
                 f"{int(changed.iloc[:4].sum())}. Space against deletion on {agreement_traces} traces: kappa "
                 f"{kappa:.3f} per position."))
add("occlusion labels under a forced answer: where the windows that change the answer lie (Qwen2.5-0.5B, GSM8K)",
    "–", f"{where_summary(where)}; space vs deletion kappa {kappa:.3f} per position ({agreement_traces} traces)", "–",
    len(space),
    "labels concentrated at the end of the reasoning", "qwen2.5-0.5b-gsm8k-forced")

# %% [markdown]
# ### E1–E4 and V1 under the forced-answer labels
#
# The same statistics as above, from the study re-run on the same traces with the labels of the forced-answer
# protocol (`results/qwen2.5-0.5b-gsm8k-forced/`), beside the committed study's (Fisher-z intervals in both, as
# above, and the t-interval on per-trace z where the study has it): the band layers of rolling-mean g_l, the raw
# signal at the strongest layer, the positional trend the z-score removes, and the deployed scores of H2O, ValueDiff,
# KeyDiff, recency and EpiKV.

# %%
def offline_statistics(folder: Path) -> dict:
    """The offline rows of one study folder (its layers.csv, positional.csv and ranking.csv)."""
    rows = pd.read_csv(folder / "layers.csv")
    rows = rows[rows["family"] == "hidden_diff"].assign(layer=lambda t: t["layer"].astype(int))
    mean = rows[rows["transform"] == f"mean{window}"].set_index("layer").sort_index()
    raw_g = rows[rows["transform"] == "raw"].set_index("layer").sort_index()
    z_g = rows[rows["transform"] == f"z{window}"].set_index("layer").sort_index()
    strongest = mean["within_rho"].abs().idxmax()
    trend = pd.read_csv(folder / "positional.csv").set_index("layer")
    trend_row = trend.loc[trend["raw_position_rho"].abs().idxmax()]
    scores = pd.read_csv(folder / "ranking.csv")

    def score(policy: str) -> str:
        r = deployed(policy, scores)
        return f"{r['within_rho']:+.3f} {interval(r['within_lo'], r['within_hi'])}"

    return {
        "layers with rolling-mean rho > 0 (interval)": str(mean.index[mean["within_lo"] > 0].tolist()),
        "layers with rolling-mean rho < 0 (interval)": str(mean.index[mean["within_hi"] < 0].tolist()),
        # The t-interval on per-trace z (the significance interval of studies run since it exists; older ones have
        # only the Fisher-z interval above).
        "layers with rho > 0 / < 0 (t-interval)": f"{mean.index[mean['within_t_lo'] > 0].tolist()} / "
        f"{mean.index[mean['within_t_hi'] < 0].tolist()}" if "within_t_lo" in mean else "–",
        "strongest layer, rolling-mean rho": f"{strongest}: {mean.loc[strongest, 'within_rho']:+.3f} "
        f"{interval(mean.loc[strongest, 'within_lo'], mean.loc[strongest, 'within_hi'])}",
        "raw rho at that layer": f"{raw_g.loc[strongest, 'within_rho']:+.3f}",
        "best |rho| after the z-score": f"{z_g['within_rho'].abs().max():.3f}",
        "|position rho| raw -> z (layer)": f"{abs(trend_row['raw_position_rho']):.3f} -> "
        f"{abs(trend_row['detrended_position_rho']):.3f} ({trend_row.name})",
        **{f"{policy} rho": score(policy) for policy in ("h2o", "valuediff", "keydiff", "recency", "epikv")},
    }


restated = next((root / "qwen2.5-0.5b-gsm8k-forced" / "stages").glob("selection-*"))  # its selection stage's tables
display(pd.DataFrame({"earlier labels": offline_statistics(study_dir),
                      "forced-answer labels": offline_statistics(restated)}))

# %% [markdown]
# ## The forced-answer study's evictor: random against every deployed scorer at a quarter and at half of each trace
# Eviction reads no label, so at half the trace these are the earlier study's cells; a quarter is new. Then the
# question the ranking rests on: does a scorer's offline rho order the scorers as evicting by them does? Spearman's
# rho across the deployed scorers, per budget, recomputed here with scipy from the two tables.

# %%
from scipy.stats import spearmanr

forced_dir = root / "qwen2.5-0.5b-gsm8k-forced"
forced = read_comparisons(forced_dir / "compare.csv")
display_comparisons(forced)
forced_scores = pd.read_csv(restated / "ranking.csv")
evicting = forced[forced["budget_a"].notna()]
for budget, rows in evicting.groupby("budget_a"):
    add_best_against_random(rows, forced_dir.name,
                            f"random (prompt kept) matches the best scored policy, budget {budget:g}")
    offline_rho = [deployed(name, forced_scores)["within_rho"] for name in rows["config"]]
    agreement = spearmanr(offline_rho, rows["difference"]).statistic
    add(f"the offline rho orders the scorers as eviction does, budget {budget:g}", "–",
        f"Spearman {agreement:+.2f} over {len(rows)} scorers", "see the study report", len(rows),
        "measured", forced_dir.name)

# %% [markdown]
# ## Qwen2.5-Coder-1.5B on GSM8K and MATH-500: the same loop on a larger model and a harder task, its evictor
# The 1.5B studies (`results/qwen2.5-1.5b-gsm8k/`: 45 correctly answered vLLM traces; `results/qwen2.5-1.5b-math500/`:
# 37, up to 1,024 new tokens; forced-answer labels) evicted at a quarter of each trace and, in a second run on the
# same labels, at half (`half/`). The best scored policy against random at each budget, and Spearman's rho
# between the offline rho and the deployed difference across the six scorers, per budget and recomputed here with
# scipy. Where Random Attention's own protocol ran on the same problems (`random-attention/` at a quarter,
# `random-attention-half/` at half), its best scored policy against random as well.

# %%
larger_runs = {"GSM8K": ("qwen2.5-1.5b-gsm8k", ["compare.csv", "half/compare.csv"]),
               "MATH-500": ("qwen2.5-1.5b-math500", ["compare.csv", "half/compare.csv"])}
for task, (folder, tables) in larger_runs.items():
    larger_dir = root / folder
    larger = read_comparisons(*(larger_dir / table for table in tables))
    display(Markdown(f"**{task}**"))
    display_comparisons(larger)
    larger_scores = pd.read_csv(next((larger_dir / "stages").glob("selection-*")) / "ranking.csv")
    agreements = []
    for budget, rows in larger[larger["budget_a"].notna()].groupby("budget_a"):
        add_best_against_random(rows, folder, "random (prompt kept) matches the best scored policy, "
                                f"Qwen2.5-1.5B, {task}, budget {budget:g}")
        offline_rho = [deployed(name, larger_scores)["within_rho"] for name in rows["config"]]
        agreements.append(spearmanr(offline_rho, rows["difference"]).statistic)
        add(f"the offline rho orders the scorers as eviction does, Qwen2.5-1.5B, {task}, budget {budget:g}", "–",
            f"Spearman {agreements[-1]:+.2f} over {len(rows)} scorers", "see the study's command.txt and report.md",
            len(rows), "measured", folder)
    display(Markdown(f"{task}, mean over {len(agreements)} budget(s): Spearman "
                     f"{sum(agreements) / len(agreements):+.2f}."))
    # Random Attention's own protocol (periodic eviction past a 64-token buffer, T = 0.6) on the same problems, where
    # run: the claim is the same, the cells are sampled, so full is the reference a scored policy could reach.
    for protocol_table in sorted(larger_dir.glob("random-attention*/compare.csv")):
        sampled = read_comparisons(protocol_table)
        display(Markdown(f"{task}, Random Attention's protocol (`{protocol_table.parent.name}/`)"))
        display_comparisons(sampled)
        for budget, rows in sampled.groupby("budget_a"):
            add_best_against_random(rows, f"{folder}/{protocol_table.parent.name}",
                                    "random (prompt kept) matches the best scored policy under Random Attention's "
                                    f"protocol, Qwen2.5-1.5B, {task}, budget {budget:g}")

# %% [markdown]
# ## Qwen2.5-Coder-1.5B: where its labels lie and how the scorers rank, on GSM8K and on MATH-500
# The forced-answer labels of both 1.5B studies (`results/qwen2.5-1.5b-gsm8k/`, `results/qwen2.5-1.5b-math500/`,
# vLLM traces checked token for token against kvscope's greedy decoding), counted by place as for the 0.5B above,
# and the offline statistics of each study's selection stage (Fisher-z intervals; the t-interval per layer).

# %%
larger_studies = {"GSM8K": root / "qwen2.5-1.5b-gsm8k" / "stages", "MATH-500": root / "qwen2.5-1.5b-math500" / "stages"}
larger_labels = {task: read_labels(next(stages.glob("labels-*/labels.jsonl")))
                 for task, stages in larger_studies.items()}
larger_places = {task: label_places(records.values()) for task, records in larger_labels.items()}
display(pd.concat(larger_places, axis=1))
# Each study's selection without label agreement (the same ranking as the one after it): the first computed.
larger_offline = {task: offline_statistics(next(s.parent for s in stages.glob("selection-*/stage.json")
                                                if "agreement" not in json.loads(s.read_text())["inputs"]))
                  for task, stages in larger_studies.items()}
display(pd.DataFrame(larger_offline))
# Label agreement across fillers: each study relabelled its first 12 traces with deletion.
larger_kappa = {task: position_kappa(larger_labels[task], read_labels(deletion))
                for task, stages in larger_studies.items()
                for deletion in stages.glob("agreement-*/delete/labels.jsonl")}
display(Markdown("; ".join(f"{task}: space against deletion on {n} traces, kappa {k:.3f} per position"
                           for task, (k, n) in larger_kappa.items())))
for task, counts in larger_places.items():
    add(f"occlusion labels under a forced answer: where the windows that change the answer lie (Qwen2.5-1.5B, {task})",
        "–", f"{where_summary(counts)}; recency rho {larger_offline[task]['recency rho']}"
        + (f"; space vs deletion kappa {larger_kappa[task][0]:.3f} per position ({larger_kappa[task][1]} traces)"
           if task in larger_kappa else ""), "–", len(larger_labels[task]),
        "labels concentrated at the end of the reasoning",
        larger_studies[task].parent.name)

# %% [markdown]
# ## The findings table

# %%
table = pd.DataFrame(findings)
display(table)
