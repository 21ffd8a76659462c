// kvscope trace viewer: colours a trace's tokens by one per-token quantity and marks what a policy kept.
// The page holds an index (#kv-index) and one JSON block per trace (#kv-trace-N), parsed when the trace is shown;
// arrays are base64 of little-endian float32 values (NaN: none) or of bits (figures/viewer/encode.py).
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const index = JSON.parse($("kv-index").textContent);
  const state = { trace: 0, quantity: null, layer: null, mode: "value", policy: "", budget: "", heads: "sum" };
  const cache = new Map();  // trace number -> decoded trace
  let view = null;          // the decoded trace on show
  let spans = [];

  function bytes(b64) {
    const text = atob(b64), out = new Uint8Array(text.length);
    for (let i = 0; i < text.length; i++) out[i] = text.charCodeAt(i);
    return out;
  }
  const floats = (b64) => new Float32Array(bytes(b64).buffer);
  const key = (layer) => layer.group + " · " + layer.name;  // a quantity: one name in one group

  function load(n) {
    if (cache.has(n)) return cache.get(n);
    const data = JSON.parse($("kv-trace-" + n).textContent);
    data.quantities = new Map();  // group + name -> {group, name, scale, ..., layers: Map(layer key -> entry)}
    for (const layer of data.layers) {
      if (!data.quantities.has(key(layer))) data.quantities.set(key(layer), { ...layer, layers: new Map() });
      data.quantities.get(key(layer)).layers.set(layer.layer === null ? "" : layer.layer, layer);
    }
    for (const run of data.runs) if (run.keep) run.keep.flags = bytes(run.keep.bits);
    cache.set(n, data);
    return data;
  }

  function values(entry) {
    if (!entry.decoded) entry.decoded = floats(entry.values);
    return entry.decoded;
  }

  function ranks(entry) {  // 1 = the highest value (kept first); ties share the smaller rank
    if (entry.ranks) return entry.ranks;
    const v = values(entry), order = [];
    for (let i = 0; i < v.length; i++) if (!Number.isNaN(v[i])) order.push(i);
    order.sort((a, b) => v[b] - v[a]);
    const r = new Float32Array(v.length).fill(NaN);
    order.forEach((i, k) => { r[i] = k > 0 && v[order[k - 1]] === v[i] ? r[order[k - 1]] : k + 1; });
    entry.ranks = r;
    entry.count = order.length;
    return r;
  }

  // ----------------------------------------------------------------------------------------- colours
  const CATEGORY_COLOURS = {
    filler: "#ececec", "decoy note": "#c6dbef", "decoy value": "#6baed6", key: "#fdd0a2", planted: "#e6550d",
    same: "#e5f5e0", no_answer: "#d9d9d9", degenerate: "#bcbddc", different: "#e34a33",
  };
  const PALETTE = ["#8dd3c7", "#fdb462", "#bebada", "#fb8072", "#80b1d3", "#b3de69", "#fccde5", "#ffffb3"];
  const mix = (a, b, t) => a.map((x, i) => Math.round(x + (b[i] - x) * t));
  const rgb = (c) => `rgb(${c[0]},${c[1]},${c[2]})`;
  const LOW = [247, 251, 255], HIGH = [8, 69, 148], NEG = [33, 102, 172], POS = [178, 24, 43], WHITE = [247, 247, 247];

  function categoryColour(q, index) {
    const name = q.categories[index];
    return CATEGORY_COLOURS[name] || PALETTE[index % PALETTE.length];
  }

  function percentile(sorted, p) { return sorted.length ? sorted[Math.min(sorted.length - 1, Math.floor(p * (sorted.length - 1)))] : NaN; }

  // A colouring: for each token a background (or "") and what the legend says.
  function colouring(q, entry) {
    const v = values(entry), n = v.length, colours = new Array(n).fill("");
    if (q.scale === "categorical") {
      for (let i = 0; i < n; i++) if (!Number.isNaN(v[i])) colours[i] = categoryColour(q, v[i]);
      return { colours, legend: q.categories.map((c, i) => [categoryColour(q, i), c]) };
    }
    if (q.scale === "binary") {
      for (let i = 0; i < n; i++) if (!Number.isNaN(v[i])) colours[i] = v[i] > 0 ? "#e34a33" : "#e5f5e0";
      return { colours, legend: [["#e34a33", "1"], ["#e5f5e0", "0"]] };
    }
    if (q.ranked && state.mode === "rank") {
      const r = ranks(entry), count = entry.count;
      for (let i = 0; i < n; i++) if (!Number.isNaN(r[i])) colours[i] = rgb(mix(LOW, HIGH, count > 1 ? (count - r[i]) / (count - 1) : 1));
      return { colours, ramp: [rgb(LOW), rgb(HIGH)], lo: `rank ${count}`, hi: "rank 1 (highest)" };
    }
    const finite = Array.from(v).filter((x) => !Number.isNaN(x)).sort((a, b) => a - b);
    if (q.scale === "signed") {
      const big = percentile(finite.map(Math.abs).sort((a, b) => a - b), 0.98) || 1;
      for (let i = 0; i < n; i++) {
        if (Number.isNaN(v[i])) continue;
        const t = Math.max(-1, Math.min(1, v[i] / big));
        colours[i] = rgb(t < 0 ? mix(WHITE, NEG, -t) : mix(WHITE, POS, t));
      }
      return { colours, ramp: [rgb(NEG), rgb(WHITE), rgb(POS)], lo: fmt(-big), hi: fmt(big) };
    }
    const lo = percentile(finite, 0.02), hi = percentile(finite, 0.98), span = hi - lo || 1;
    for (let i = 0; i < n; i++) {
      if (!Number.isNaN(v[i])) colours[i] = rgb(mix(LOW, HIGH, Math.max(0, Math.min(1, (v[i] - lo) / span))));
    }
    return { colours, ramp: [rgb(LOW), rgb(HIGH)], lo: fmt(lo), hi: fmt(hi) };
  }

  function fmt(x) {
    if (x === null || x === undefined || Number.isNaN(x)) return "–";
    const a = Math.abs(x);
    return a !== 0 && (a < 1e-3 || a >= 1e5) ? x.toExponential(2) : x.toPrecision(4).replace(/\.?0+$/, "");
  }

  function dark(colour) {  // whether white text reads better on it
    const c = colour.startsWith("#") ? [1, 3, 5].map((j) => parseInt(colour.slice(j, j + 2), 16)) : colour.match(/\d+/g).map(Number);
    return 0.299 * c[0] + 0.587 * c[1] + 0.114 * c[2] < 150;
  }

  // ----------------------------------------------------------------------------------------- selectors
  function options(select, items, chosen) {  // items: [value, text] or {group, items}
    select.innerHTML = "";
    for (const item of items) {
      if (item.group !== undefined) {
        const og = document.createElement("optgroup");
        og.label = item.group;
        for (const [value, text] of item.items) og.append(new Option(text, value));
        select.append(og);
      } else select.append(new Option(item[1], item[0]));
    }
    const values = Array.from(select.options).map((o) => o.value);
    select.value = values.includes(chosen) ? chosen : (values[0] ?? "");
    select.disabled = values.length <= 1 && select.id !== "kv-trace";
    return select.value;
  }

  function run() {
    return view.runs.find((r) => r.name === state.policy && r.budget === state.budget) || null;
  }

  function layerName(layer) { return layer === "agg" ? "all layers (aggregate)" : layer === "" ? "–" : "layer " + layer; }

  function fillSelectors() {
    const groups = [];
    for (const [k, q] of view.quantities) {
      let g = groups.find((x) => x.group === q.group);
      if (!g) groups.push((g = { group: q.group, items: [] }));
      g.items.push([k, q.name]);
    }
    state.quantity = options($("kv-quantity"), groups, state.quantity);
    const q = view.quantities.get(state.quantity);
    const policies = [...new Set(view.runs.map((r) => r.name))];
    state.policy = options($("kv-policy"), [["", "none"], ...policies.map((p) => [p, p])], state.policy);
    const budgets = view.runs.filter((r) => r.name === state.policy).map((r) => [r.budget, r.budget]);
    state.budget = options($("kv-budget"), budgets, state.budget);
    const r = run();
    const layers = new Set(q ? q.layers.keys() : []);
    if (r && r.keep) { layers.add("agg"); for (let l = 0; l < r.keep.layers; l++) layers.add(String(l)); }
    layers.delete("");
    const sorted = [...layers].sort((a, b) => (a === "agg" ? -1 : b === "agg" ? 1 : a - b));
    state.layer = options($("kv-layer"), sorted.length ? sorted.map((l) => [l, layerName(l)]) : [["", "–"]], state.layer);
    $("kv-mode").disabled = !(q && q.ranked);
    $("kv-heads").disabled = !(r && r.keep);
  }

  // The quantity's values at the chosen layer, or at its only layer when it has one score for every layer.
  function entryOf(q) {
    if (!q) return null;
    return q.layers.get(state.layer) || (q.layers.size === 1 ? q.layers.values().next().value : null);
  }

  // ----------------------------------------------------------------------------------------- tokens
  function renderTokens() {
    const box = $("kv-tokens");
    box.innerHTML = "";
    spans = [];
    const frag = document.createDocumentFragment();
    for (const [name, start, end] of view.regions) {
      const head = document.createElement("span");
      head.className = "region";
      head.textContent = `${name} · tokens ${start}–${end - 1}`;
      frag.append(head);
      for (let i = start; i < end; i++) {
        const s = document.createElement("span");
        s.className = "t";
        s.dataset.i = i;
        const text = view.tokens[i];
        if (text.includes("\n")) {
          s.textContent = text.replace(/\n/g, "");
          const mark = document.createElement("span");
          mark.className = "nl";
          mark.textContent = "↵";
          s.append(mark);
        } else s.textContent = text;
        const strip = document.createElement("i");
        strip.className = "k";
        s.append(strip);
        frag.append(s);
        spans[i] = s;
        if (text.includes("\n")) frag.append(document.createElement("br"));
      }
    }
    box.append(frag);
  }

  // The share of the chosen layers holding position i, per KV head (one layer: 0 or 1); null beyond the keep-log.
  function held(r, i) {
    const k = r.keep, n = view.tokens.length, bit = (l, h) => (k.flags[((l * k.heads + h) * n + i) >> 3] >> (((l * k.heads + h) * n + i) & 7)) & 1;
    const layers = state.layer === "agg" || state.layer === "" ? [...Array(k.layers).keys()] : [Number(state.layer)];
    if (layers[0] >= k.layers) return null;  // a layer the keep-log does not cover
    const perHead = [];
    for (let h = 0; h < k.heads; h++) { let c = 0; for (const l of layers) c += bit(l, h); perHead.push(c / layers.length); }
    return perHead;
  }

  function inRun(r, i) {
    return r.diverges_at === null || i < r.diverges_at;
  }

  function paint() {
    const q = view.quantities.get(state.quantity), entry = entryOf(q);
    const c = entry ? colouring(q, entry) : { colours: [], legend: [] };
    const r = run(), keep = r && r.keep;
    for (let i = 0; i < spans.length; i++) {
      const s = spans[i];
      const bg = c.colours[i] || "";
      s.style.background = bg;
      s.style.color = bg && dark(bg) ? "#fff" : "";
      const strip = s.lastChild;
      const heads = keep && inRun(r, i) ? held(r, i) : null;
      if (!heads) { strip.style.background = ""; s.classList.remove("gone"); continue; }
      const total = heads.reduce((a, b) => a + b, 0) / heads.length;
      s.classList.toggle("gone", total === 0);
      if (state.heads === "each") {
        const h = heads.length, stops = heads.map((f, j) => `${rgb(mix([215, 48, 31], [58, 58, 60], f))} ${(100 * j) / h}% ${(100 * (j + 1)) / h}%`);
        strip.style.height = Math.min(3 * h, 12) + "px";
        strip.style.background = `linear-gradient(to bottom, ${stops.join(", ")})`;
      } else {
        strip.style.height = "3px";
        strip.style.background = rgb(mix([215, 48, 31], [58, 58, 60], total));
      }
    }
    legend(q, entry, c, r);
    summary(r);
  }

  function legend(q, entry, c, r) {
    const box = $("kv-legend");
    box.innerHTML = "";
    const add = (html) => { const d = document.createElement("span"); d.innerHTML = html; box.append(d); };
    if (!q) add("nothing to colour by in this trace");
    else if (!entry) add(`${esc(q.name)} has no value at ${esc(layerName(state.layer))}`);
    else {
      const where = q.layers.size > 1 || entry.layer === null ? "" : ` (${esc(layerName(entry.layer))})`;
      add(`<b>${esc(q.group)} · ${esc(q.name)}</b>${where}${q.description ? " — " + esc(q.description) : ""}`);
      if (c.legend) for (const [colour, text] of c.legend) add(`<span class="swatch" style="background:${colour}"></span>${esc(text)}`);
      if (c.ramp) add(`${c.lo} <span class="ramp" style="display:inline-block;background:linear-gradient(to right, ${c.ramp.join(", ")})"></span> ${c.hi}`);
      add("uncoloured: no value");
    }
    if (r && r.keep) add(`strip under each token: <span class="swatch" style="background:var(--kept)"></span>held by the KV head(s) at the end of the run, <span class="swatch" style="background:var(--evicted)"></span>evicted; struck through: evicted by every head shown`);
  }

  function esc(text) {
    return String(text).replace(/[&<>"]/g, (ch) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[ch]);
  }

  function verdict(correct) { return correct === true ? '<span class="ok">correct</span>' : correct === false ? '<span class="bad">wrong</span>' : "ungraded"; }

  function summary(r) {
    const s = view.summary;
    const lines = [`<div>trace <b>${esc(view.id)}</b>: answer <b>${esc(s.answer ?? "–")}</b> (gold ${esc(s.gold ?? "–")}, ${verdict(s.correct)}); ${s.prompt_tokens} prompt + ${s.generated_tokens} generated tokens</div>`];
    if (r) {
      const budget = r.budget === "dense" ? "no eviction" : `budget ${esc(r.budget)}${r.budget_tokens !== null ? ` (${r.budget_tokens} tokens)` : ""}`;
      lines.push(`<div><b>${esc(r.name)}</b>, ${budget}: answered <b>${esc(r.answer ?? "nothing")}</b> (${verdict(r.correct)})${r.rounds !== null ? `; ${r.rounds} eviction rounds` : ""}${r.peak_slots !== null ? `, peak ${r.peak_slots} cache slots per head` : ""}</div>`);
      if (r.note) lines.push(`<div class="run-text">${esc(r.note)}</div>`);
      if (r.diverges_at !== null) lines.push(`<div class="run-text">from token ${r.diverges_at} on, this run wrote: ${esc(r.continuation)}</div>`);
    } else lines.push("<div></div>");
    $("kv-info").innerHTML = lines.join("");
  }

  // ----------------------------------------------------------------------------------------- hover
  function tip(event) {
    const s = event.target.closest(".t"), box = $("kv-tip");
    if (!s) { box.hidden = true; return; }
    const i = Number(s.dataset.i), rows = [];
    const region = view.regions.find(([, a, b]) => i >= a && i < b);
    rows.push(`<b>token ${i}</b> ${esc(JSON.stringify(view.tokens[i]))} · ${region ? region[0] : ""}`);
    const table = (title, items) => {
      if (!items.length) return;
      rows.push(`<div class="h">${esc(title)}</div><table>${items.map((cells) => `<tr>${cells.map((c, j) => `<td${j ? ' class="n"' : ""}>${c}</td>`).join("")}</tr>`).join("")}</table>`);
    };
    const groups = new Map();
    for (const q of view.quantities.values()) {
      const entry = entryOf(q);
      if (!entry) continue;
      const v = values(entry)[i];
      if (Number.isNaN(v)) continue;
      const shown = q.scale === "categorical" ? esc(q.categories[v]) : fmt(v);
      const rank = q.ranked ? `rank ${ranks(entry)[i]} of ${entry.count}` : "";
      const mark = key(q) === state.quantity ? "<b>" + esc(q.name) + "</b>" : esc(q.name);
      if (!groups.has(q.group)) groups.set(q.group, []);
      groups.get(q.group).push([mark, shown, rank]);
    }
    const layer = state.layer && state.layer !== "agg" ? ` at layer ${state.layer}` : "";
    for (const [group, items] of groups) table(group + (items.some((x) => x[2]) ? layer : ""), items);
    for (const [set, windows] of Object.entries(view.windows)) {
      const covering = windows.filter((w) => i >= w.start && i < w.end);
      table(`${set}: windows over this token`, covering.map((w) => [`[${w.start}, ${w.end})`,
        Object.entries(w).filter(([k]) => k !== "start" && k !== "end")
          .map(([k, v]) => `${esc(k)} ${typeof v === "number" ? fmt(v) : esc(String(v).slice(0, 48))}`).join(" · ")]));
    }
    const r = run();
    if (r && r.keep) {
      if (!inRun(r, i)) rows.push(`<div class="h">${esc(r.name)}</div>this run had another token here`);
      else if (!held(r, i)) rows.push(`<div class="h">${esc(r.name)}</div>its keep-log has no layer ${state.layer}`);
      else {
        const heads = held(r, i);
        const where = state.layer === "agg" ? "share of layers holding it, per KV head" : `layer ${state.layer}, per KV head`;
        rows.push(`<div class="h">${esc(r.name)} at the end of the run</div>${where}: ${heads.map((f, h) => `h${h} ${state.layer === "agg" ? fmt(f) : f ? "held" : "evicted"}`).join(" · ")}`);
      }
    }
    box.innerHTML = rows.join("");
    box.hidden = false;
    const x = Math.min(event.clientX + 14, window.innerWidth - box.offsetWidth - 8);
    const y = event.clientY + 16 + box.offsetHeight > window.innerHeight ? event.clientY - box.offsetHeight - 10 : event.clientY + 16;
    box.style.left = Math.max(4, x) + "px";
    box.style.top = Math.max(4, y) + "px";
  }

  // ----------------------------------------------------------------------------------------- wiring
  function showTrace(n) {
    state.trace = n;
    view = load(n);
    renderTokens();
    fillSelectors();
    paint();
  }

  function init() {
    document.title = index.title;
    $("kv-title").textContent = index.title;
    $("kv-notes").innerHTML = index.notes.map((n) => `<div>${esc(n)}</div>`).join("");
    options($("kv-trace"), index.traces.map((t, n) => [String(n), `${t.id} (${t.n_tokens} tokens${t.correct === true ? ", correct" : t.correct === false ? ", wrong" : ""})`]), "0");
    $("kv-trace").addEventListener("change", (e) => showTrace(Number(e.target.value)));
    for (const [id, field] of [["kv-quantity", "quantity"], ["kv-layer", "layer"], ["kv-mode", "mode"], ["kv-policy", "policy"], ["kv-budget", "budget"], ["kv-heads", "heads"]]) {
      $(id).addEventListener("change", (e) => { state[field] = e.target.value; fillSelectors(); paint(); });
    }
    $("kv-tokens").addEventListener("mousemove", tip);
    $("kv-tokens").addEventListener("mouseleave", () => { $("kv-tip").hidden = true; });
    if (index.traces.length) showTrace(0);
    performance.mark("kv-ready");  // the first trace drawn: what a test times the page's opening by
    document.body.dataset.ready = "1";
  }

  init();
})();
