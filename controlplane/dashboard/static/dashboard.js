/*
 * The heteroplane dashboard: polls /dashboard/data every 2 s (the sign-in cookie goes with it)
 * and draws each panel from the snapshot (controlplane/dashboard/snapshot.py documents it).
 *
 * Every panel ends in data-state "ready" (drawn from data), "partial" (drawn, with a note on
 * what is missing) or "empty" (nothing to draw yet, with a note saying what it waits for).
 * document.body.dataset.generatedAt is the time of the snapshot on screen.
 */
(function () {
  "use strict";

  const POLL_MS = 2000;
  const DEFAULT_WINDOW_S = 1800;
  // The data route's bounds of a window (snapshot.py MIN_WINDOW_S, MAX_WINDOW_S) and of an
  // app's name (the API's AppName).
  const MIN_WINDOW_S = 60;
  const MAX_WINDOW_S = 86400;
  const APP_NAME = /^[a-z0-9]([a-z0-9-]*[a-z0-9])?$/;
  const H = window.HPCharts;
  const $ = (id) => document.getElementById(id);
  const params = new URLSearchParams(window.location.search);
  const notices = [];
  const state = {
    // The app on screen: pinned once drawn, so that a new app that sorts first (the data route's
    // default) never takes its place.
    app: appParam(params.get("app")),
    // The app on screen was deleted: say so, draw nothing, until the operator picks another.
    gone: false,
    // Whether state.app has been drawn (a never-drawn app that is not there is dropped instead).
    drawn: false,
    windowS: windowParam(params.get("window_s")),
    // What the address asked for that the page could not show, said in the banner until the
    // operator picks an app or a window.
    notice: null,
    seenDecisions: null,
    decisionKind: params.get("kind") || "",
    lastSnap: null,
    freshUntil: new Map(),
    lastBody: null,
    timer: null,
    requests: 0,
    failures: 0,
  };
  state.notice = notices.join(" ") || null;
  const KIND_COLORS = {};
  const GEAR_COLORS = {};

  // The address's app: a name the data route would refuse (422) is dropped, with a notice.
  function appParam(value) {
    if (value === null || value === "") return null;
    if (value.length <= 63 && APP_NAME.test(value)) return value;
    notices.push("There is no app '" + value + "' (names are lower case letters, digits and dashes): showing the first app.");
    return null;
  }

  // The address's window: one outside what the data route takes is clamped to the choices the
  // page offers (5 minutes to 24 hours), one that is not a number is the default 30 minutes.
  function windowParam(value) {
    if (value === null || value === "") return DEFAULT_WINDOW_S;
    const seconds = Number(value);
    let chosen = seconds;
    if (!Number.isFinite(seconds) || seconds <= 0) chosen = DEFAULT_WINDOW_S;
    else if (seconds < MIN_WINDOW_S) chosen = 300;
    else if (seconds > MAX_WINDOW_S) chosen = MAX_WINDOW_S;
    if (chosen !== seconds) notices.push("A window of " + value + " s is not offered: showing " + windowLabel(chosen) + ".");
    return chosen;
  }

  function windowLabel(seconds) {
    const minutes = seconds / 60;
    return minutes >= 60 ? +(minutes / 60).toFixed(1) + " h" : +minutes.toFixed(1) + " min";
  }

  // --- formatting ---------------------------------------------------------------------------

  const finite = (v) => typeof v === "number" && Number.isFinite(v);
  const usd = (v, digits) => (finite(v) ? "$" + v.toFixed(digits === undefined ? 2 : digits) : "–");
  // Whole dollars without their cents ("$96"), others with them ("$2.88").
  const dollars = (v) => (finite(v) && Math.abs(v - Math.round(v)) < 0.005 ? usd(v, 0) : usd(v));
  const qps = (v) => (finite(v) ? (v >= 100 ? v.toFixed(0) : v.toFixed(1)) + " qps" : "–");
  const ms = (v) => (finite(v) ? (v >= 100 ? v.toFixed(0) : v.toFixed(1)) + " ms" : "–");
  const pct = (v) => (finite(v) ? (100 * v).toFixed(1) + "%" : "–");
  const plural = (n, word) => n + " " + word + (n === 1 ? "" : "s");

  function duration(seconds) {
    if (!finite(seconds)) return "–";
    const s = Math.round(seconds);
    if (s < 60) return s + "s";
    if (s < 3600) return Math.floor(s / 60) + "m " + String(s % 60).padStart(2, "0") + "s";
    if (s < 86400) return Math.floor(s / 3600) + "h " + String(Math.floor((s % 3600) / 60)).padStart(2, "0") + "m";
    return Math.floor(s / 86400) + "d " + Math.floor((s % 86400) / 3600) + "h";
  }

  function fleetText(fleet) {
    const parts = Object.entries(fleet || {})
      .filter(([, n]) => n)
      .sort((a, b) => (a[0] < b[0] ? -1 : 1))
      .map(([t, n]) => n + " × " + t);
    return parts.length ? parts.join(", ") : "none";
  }

  function colorFor(map, key, offset) {
    if (!(key in map)) map[key] = H.PALETTE[(Object.keys(map).length + (offset || 0)) % H.PALETTE.length];
    return map[key];
  }

  function el(tag, attrs, children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (key === "text") node.textContent = value;
      else if (key === "class") node.className = value;
      else node.setAttribute(key, value);
    }
    for (const child of children || []) if (child !== null && child !== undefined) node.appendChild(child);
    return node;
  }

  function setPanel(name, status, message) {
    const panel = document.querySelector('[data-panel="' + name + '"]');
    panel.dataset.state = status;
    const empty = panel.querySelector(".empty");
    if (empty) empty.textContent = message || "";
  }

  function tile(id, value, sub, tone) {
    const node = $(id);
    const v = node.querySelector(".v");
    v.textContent = value;
    v.title = value; // the whole text on hover, where the tile is too narrow for it
    node.querySelector(".s").textContent = sub || "";
    node.classList.toggle("bad", tone === "bad");
    node.classList.toggle("ok", tone === "ok");
  }

  // --- panels -------------------------------------------------------------------------------

  function renderFleet(snap) {
    const fleet = snap.fleet;
    const types = Object.keys(fleet.series.by_type);
    const layers = types.map((t) => ({ label: t, color: colorFor(GEAR_COLORS, "type:" + t), v: fleet.series.by_type[t] }));
    H.stack($("fleet-chart"), {
      t0: snap.window.start, t1: snap.window.end, t: fleet.series.t, layers: layers, height: 140,
      title: "instances by type",
    });
    H.legend($("fleet-legend"), layers.map((l) => ({ label: l.label, color: l.color })));
    const now = fleet.now;
    tile("tile-fleet", now.instances + " inst.", now.running + " running · " + plural(Object.keys(now.by_type).length, "type"));
    if (!types.length) {
      setPanel("fleet", "empty", "No instances yet: the reconciler launches the applied plan's fleet.");
    } else {
      setPanel("fleet", "ready");
    }
    renderInstances(fleet.instances);
  }

  // "emu.cpu.small" as text that may break after its dots (and nowhere else) on a narrow panel.
  function breakable(name) {
    const nodes = [];
    name.split(".").forEach((part, i, parts) => {
      nodes.push(document.createTextNode(part + (i < parts.length - 1 ? "." : "")));
      if (i < parts.length - 1) nodes.push(el("wbr"));
    });
    return nodes;
  }

  function renderInstances(rows) {
    const body = $("instance-table").querySelector("tbody");
    const trs = rows.map((row) => {
      const util = finite(row.utilisation_share)
        ? el("span", {}, [
          el("span", { class: "bar" }, [(() => {
            const fill = el("i");
            fill.style.width = Math.round(100 * Math.min(1, row.utilisation_share)) + "%";
            return fill;
          })()]),
          document.createTextNode(pct(row.utilisation_share)),
        ])
        : document.createTextNode("–");
      let models = "–";
      if (Array.isArray(row.models)) {
        models = row.models.map((m) => (typeof m === "object" && m ? (m.name || m.model || "?") + (m.state ? ": " + m.state : "") : String(m))).join(", ");
      } else if (row.models && typeof row.models === "object") {
        models = Object.entries(row.models).map(([k, v]) => k + ": " + (typeof v === "object" && v ? (v.state || JSON.stringify(v)) : v)).join(", ");
      }
      return el("tr", { class: row.live ? "" : "ended", "data-instance-id": row.id }, [
        el("td", {}, breakable(row.instance_type)),
        el("td", {}, [el("span", { class: "state " + row.state, text: row.state })]),
        el("td", { class: "num", text: duration(row.uptime_s) }),
        el("td", { class: "num", text: usd(row.price_usd_per_hr, 3) }),
        el("td", {}, [util]),
        el("td", { text: models }),
        el("td", { title: row.provider_id || "" }, [el("code", { text: row.id.slice(0, 8) })]),
      ]);
    });
    body.replaceChildren(...trs);
    if (!rows.length) setPanel("instances", "empty", "No instances yet.");
    else if (!rows.some((r) => finite(r.utilisation_share) || r.models)) {
      setPanel("instances", "partial", "Utilisation and model states appear once the serving loop has served the app.");
    } else setPanel("instances", "ready");
  }

  function renderCost(snap) {
    const cost = snap.cost;
    const series = [
      { label: "fleet cost", color: "#4e79a7", t: cost.series.t, v: cost.series.fleet_cost_usd_per_hr, step: true, fill: true },
      { label: "budget", color: "#d62728", t: cost.budget.t, v: cost.budget.usd_per_hr, step: true, dash: "6 4", width: 1.6 },
    ];
    H.time($("cost-chart"), {
      t0: snap.window.start, t1: snap.window.end, series: series, yMin: 0, height: 120,
      yFormat: (v) => "$" + (+v.toFixed(2)), title: "burn rate against the budget",
    });
    H.legend($("cost-legend"), [
      { label: "burn rate (fleet $/hr)", color: "#4e79a7", kind: "line" },
      { label: "budget $/hr", color: "#d62728", kind: "dash" },
    ]);
    const figures = [
      ["burn rate", usd(cost.burn_usd_per_hr) + "/hr"],
      ["budget", usd(cost.budget_usd_per_hr) + "/hr"],
      ["spent today", usd(cost.spent_today_usd)],
      ["forecast today", usd(cost.forecast_today_usd)],
      ["budget for the day", usd(cost.budget_today_usd)],
      ["hours left today", cost.hours_left_today.toFixed(1) + " h"],
    ];
    $("cost-figures").replaceChildren(...figures.map(([k, v]) => el("div", {}, [el("dt", { text: k }), el("dd", { text: v })])));
    const over = cost.burn_usd_per_hr > cost.budget_usd_per_hr + 1e-9;
    tile("tile-burn", usd(cost.burn_usd_per_hr) + "/hr", "budget " + usd(cost.budget_usd_per_hr) + "/hr", over ? "bad" : "ok");
    tile("tile-spend", usd(cost.spent_today_usd), "since 00:00 UTC");
    tile("tile-forecast", usd(cost.forecast_today_usd), "of " + dollars(cost.budget_today_usd) + " at budget",
      cost.forecast_today_usd > cost.budget_today_usd ? "bad" : undefined);
    if (!cost.series.t.length) setPanel("cost", "empty", "No samples yet: the roll-up records the fleet cost every few seconds.");
    else setPanel("cost", "ready");
  }

  function renderLoad(snap) {
    const load = snap.load;
    const series = [
      { label: "capacity", color: "#59a14f", t: load.capacity.t, v: load.capacity.capacity_qps, step: true, fill: true, width: 1.5 },
      { label: "arrival rate", color: "#4e79a7", t: load.series.t, v: load.series.arrival_rate_qps, width: 2 },
    ];
    const hlines = [];
    if (finite(load.planned_rate_qps)) {
      hlines.push({ value: load.planned_rate_qps, label: "planned " + qps(load.planned_rate_qps), color: "#f28e2b", dash: "6 4" });
    }
    H.time($("load-chart"), {
      t0: snap.window.start, t1: snap.window.end, series: series, hlines: hlines, yMin: 0, height: 130,
      yFormat: (v) => String(+v.toFixed(1)), title: "arrival rate against capacity",
    });
    const legend = [
      { label: "arrival rate (qps)", color: "#4e79a7", kind: "line" },
      { label: "provisioned capacity", color: "#59a14f", kind: "line" },
    ];
    if (hlines.length) legend.push({ label: "planned rate", color: "#f28e2b", kind: "dash" });
    H.legend($("load-legend"), legend);
    const env = load.envelope;
    if (env && env.windows_s.length) {
      const xs = env.windows_s;
      H.xy($("envelope-chart"), {
        x0: xs[0], x1: xs[xs.length - 1], xLog: xs[xs.length - 1] / xs[0] > 10, height: 80,
        xTicks: xs.filter((_, i) => i % Math.ceil(xs.length / 6) === 0),
        xFormat: (x) => (x >= 1 ? +x.toFixed(1) + "s" : Math.round(x * 1000) + "ms"),
        series: [
          { label: "planned envelope", color: "#f28e2b", x: xs, y: env.rate_qps, dash: "6 4" },
          { label: "live envelope", color: "#4e79a7", x: xs, y: env.live_rate_qps || [] },
        ],
        title: "arrival envelope",
      });
      $("envelope-note").textContent = "Envelope: highest rate over each window, planned (dashed) and live.";
    } else {
      $("envelope-chart").replaceChildren();
      $("envelope-note").textContent = "The plan carries no arrival envelope.";
    }
    const cap = load.capacity_qps;
    const rate = load.arrival_rate_qps;
    tile("tile-load", finite(rate) ? qps(rate) : "–", "capacity " + qps(cap), finite(rate) && finite(cap) && rate > cap ? "bad" : undefined);
    if (!load.has_traffic) setPanel("load", load.capacity.t.length && finite(cap) ? "partial" : "empty", "No traffic yet: the arrival rate is 0.");
    else setPanel("load", "ready");
  }

  function renderLatency(snap) {
    const lat = snap.latency;
    const t = lat.series.t;
    const series = [
      { label: "P50", color: "#59a14f", t: t, v: lat.series.p50_ms },
      { label: "P95", color: "#edc948", t: t, v: lat.series.p95_ms, width: 1.2 },
      { label: "P99", color: "#4e79a7", t: t, v: lat.series.p99_ms, width: 2 },
    ];
    const hlines = finite(lat.slo_ms)
      ? [{ value: lat.slo_ms, label: "SLO P" + lat.percentile + " " + ms(lat.slo_ms), color: "#d62728" }]
      : [];
    // The plan's end-to-end prediction: what the estimator said the P99 would be at the planned rate.
    const predicted = finite(lat.predicted_p99_ms);
    if (predicted) {
      hlines.push({ value: lat.predicted_p99_ms, label: "predicted " + ms(lat.predicted_p99_ms), color: "#79706e", dash: "2 3" });
    }
    H.time($("latency-chart"), {
      t0: snap.window.start, t1: snap.window.end, series: series, hlines: hlines, yMin: 0, height: 120,
      yFormat: (v) => String(+v.toFixed(0)), title: "latency against the SLO",
    });
    const legend = [
      { label: "P50", color: "#59a14f", kind: "line" },
      { label: "P95", color: "#edc948", kind: "line" },
      { label: "P99 (ms)", color: "#4e79a7", kind: "line" },
      { label: "SLO", color: "#d62728", kind: "dash" },
    ];
    if (predicted) legend.push({ label: "plan's predicted P" + lat.percentile, color: "#79706e", kind: "dash" });
    legend.push({ label: "attainment (below)", color: "#b07aa1", kind: "line" });
    H.legend($("latency-legend"), legend);
    H.time($("attainment-chart"), {
      t0: snap.window.start, t1: snap.window.end, height: 56, yMin: 0, yMax: 1, yTicks: 2,
      series: [{ label: "attainment", color: "#b07aa1", t: t, v: lat.series.attainment_share }],
      yFormat: (v) => Math.round(v * 100) + "%", title: "share within the SLO",
    });
    // Errors (429, 503, 504, 502) are misses: a window that answered nothing has no P99 and
    // fails the SLO, and a window whose attainment is below the SLO's percentile fails it too.
    const over = (finite(lat.p99_ms) && finite(lat.slo_ms) && lat.p99_ms > lat.slo_ms) || lat.slo_met === false;
    if (lat.answered_none) tile("tile-latency", "none answered", "SLO P" + lat.percentile + " " + ms(lat.slo_ms), "bad");
    else tile("tile-latency", ms(lat.p99_ms), "SLO P" + lat.percentile + " " + ms(lat.slo_ms), finite(lat.p99_ms) ? (over ? "bad" : "ok") : undefined);
    const share = lat.window_attainment_share;
    const out = lat.outcomes;
    const errors = out && out.errors ? " · " + plural(out.errors, "error") : "";
    tile("tile-attainment", pct(lat.attainment_share), "window " + pct(share) + errors, finite(lat.attainment_share) ? (lat.attainment_share < lat.percentile / 100 ? "bad" : "ok") : undefined);
    // The errors by kind on hover: the tile has room for their total only.
    $("tile-attainment").title = out && out.errors
      ? out.errors + " errors since the service started: " + out.refused + " refused, " + out.timed_out + " timed out, " + out.failed + " failed"
      : "";
    if (!lat.has_data) setPanel("latency", "empty", "No traffic yet: latency appears once queries are served.");
    else setPanel("latency", "ready");
  }

  function renderCascade(snap) {
    const cas = snap.cascade;
    const t = cas.series.t;
    const colors = {};
    for (const g of cas.gears) colors[g] = colorFor(GEAR_COLORS, "gear:" + g, 3);
    H.lane($("gear-chart"), { t0: snap.window.start, t1: snap.window.end, t: t, values: cas.series.gear, colors: colors, label: "gear" });
    const hlines = finite(cas.accuracy_floor)
      ? [{ value: cas.accuracy_floor, label: "floor " + pct(cas.accuracy_floor), color: "#d62728" }]
      : [];
    const measured = cas.series.accuracy.some(finite) || hlines.length;
    H.time($("accuracy-chart"), {
      t0: snap.window.start, t1: snap.window.end, height: 104, hlines: hlines,
      yMin: measured ? undefined : 0, yMax: 1,
      series: [{ label: "accuracy", color: "#e15759", t: t, v: cas.series.accuracy, step: true }],
      yFormat: (v) => (100 * v).toFixed(1) + "%", title: "accuracy",
    });
    const legend = cas.gears.map((g) => ({ label: g, color: colors[g] }));
    legend.push({ label: "accuracy", color: "#e15759", kind: "line" });
    if (hlines.length) legend.push({ label: "accuracy floor", color: "#d62728", kind: "dash" });
    H.legend($("cascade-legend"), legend);
    tile("tile-gear", cas.gear || "–", "accuracy " + pct(cas.accuracy)
      + (finite(cas.held_out_accuracy) ? " (planned " + pct(cas.held_out_accuracy) + " held out)" : ""));
    if (!cas.has_data) {
      setPanel("cascade", "empty", cas.cascade
        ? "No gear data yet: gears appear once the cascade serves queries."
        : "A single-model app: no cascade, so no gears (accuracy appears when measured).");
    } else setPanel("cascade", "ready");
  }

  function numberText(value) {
    if (finite(value)) return Math.abs(value) >= 100 || Number.isInteger(value) ? String(+value.toFixed(1)) : String(+value.toPrecision(4));
    if (Array.isArray(value)) return value.length > 4 ? value.length + " items" : value.map(numberText).join(", ");
    if (value && typeof value === "object") {
      const entries = Object.entries(value);
      if (entries.every(([, v]) => Number.isInteger(v))) return fleetText(value);
      return entries.map(([k, v]) => k + " " + numberText(v)).join(", ");
    }
    return String(value);
  }

  // The decision log's kind filter: a select made once, above the log, kept across polls.
  function decisionFilter(kinds) {
    let select = $("decision-kind");
    if (!select) {
      select = el("select", { id: "decision-kind", "aria-label": "Show decisions of kind" });
      select.addEventListener("change", () => {
        state.decisionKind = select.value;
        remember();
        if (state.lastSnap) renderDecisions(state.lastSnap);
      });
      $("decision-log").before(el("label", { class: "decision-filter" }, [document.createTextNode("Kind "), select]));
    }
    const wanted = ["", ...kinds];
    if (state.decisionKind && !wanted.includes(state.decisionKind)) wanted.push(state.decisionKind);
    const shown = Array.from(select.options).map((o) => o.value);
    if (shown.join("\n") !== wanted.join("\n")) {
      select.replaceChildren(...wanted.map((k) => el("option", { value: k, text: k ? k.replace(/_/g, " ") : "all kinds" })));
    }
    select.value = state.decisionKind || "";
  }

  function renderDecisions(snap) {
    state.lastSnap = snap;
    const all = snap.decisions;
    decisionFilter(Array.from(new Set(all.map((d) => d.kind))).sort());
    const list = state.decisionKind ? all.filter((d) => d.kind === state.decisionKind) : all;
    const now = Date.now();
    // Fresh: a new decision, or one made again since the last poll (its newest time moved; a
    // run's count may change without anything new, when its oldest member leaves the log).
    const seen = (d) => d.id + ":" + (finite(d.last_t) ? d.last_t : d.t);
    if (state.seenDecisions !== null) {
      for (const d of all) if (!state.seenDecisions.has(seen(d))) state.freshUntil.set(d.id, now + 6000);
    }
    state.seenDecisions = new Set(all.map(seen));
    const items = list.map((d) => {
      // A long figure (a launch's instance and request ids) is cut to the panel: its whole text
      // is the span's tooltip.
      const numbers = Object.entries(d.numbers || {}).map(([k, v]) =>
        el("span", { title: k + " " + numberText(v) }, [el("b", { text: k + " " }), document.createTextNode(numberText(v))]));
      const fresh = (state.freshUntil.get(d.id) || 0) > now;
      const repeated = (d.count || 1) > 1;
      // A run of one kind (consecutive gear switches, say) is one entry: the newest of it shown.
      const run = d.run || 1;
      const why = run > 1
        ? run + " " + d.kind.replace(/_/g, " ") + " decisions in a row, made " + d.count + " times; the reason and numbers are the newest's"
        : "made " + d.count + " times; the reason and numbers are the last";
      return el("li", { "data-decision-id": String(d.id), "data-kind": d.kind, "data-count": String(d.count || 1), "data-run": String(run), class: fresh ? "fresh" : "" }, [
        el("span", { class: "when", text: H.clock(d.t, true) }),
        el("span", { class: "kind " + d.kind.replace(/[^a-z0-9_]/gi, ""), text: d.kind.replace(/_/g, " ") }),
        repeated
          ? el("span", { class: "repeat", title: why,
            text: "x" + d.count + (finite(d.last_t) ? ", last " + H.clock(d.last_t, true) : "") })
          : null,
        el("span", { class: "reason", text: d.reason }),
        numbers.length ? el("span", { class: "numbers" }, numbers) : null,
      ]);
    });
    $("decision-log").replaceChildren(...items);
    const filtered = state.decisionKind ? list.length + " of " + all.length + ", " : "";
    $("decision-count").textContent = all.length ? "(newest first, " + filtered + all.length + ")" : "";
    if (!all.length) setPanel("decisions", "empty", "No decisions yet: scaling actions, gear switches and replans appear here.");
    else if (!list.length) setPanel("decisions", "partial", "No " + state.decisionKind.replace(/_/g, " ") + " decision among the newest " + all.length + ".");
    else setPanel("decisions", "ready");
  }

  function table(headers, rows, rowClass) {
    return el("div", { class: "table-wrap" }, [el("table", {}, [
      el("thead", {}, [el("tr", {}, headers.map((h) => el("th", { text: h[0], class: h[1] || "" })))]),
      el("tbody", {}, rows.map((cells, i) => el("tr", { class: rowClass ? rowClass(i) : "" },
        cells.map((c, j) => el("td", { text: c, class: headers[j][1] || "" }))))),
    ])]);
  }

  function renderPlan(snap) {
    const plan = snap.plan;
    const body = $("plan-body");
    if (!plan) {
      body.replaceChildren();
      $("plan-title").textContent = "";
      setPanel("plan", "empty", "No plan yet: preview one (POST /v1/apps/" + snap.app.name + "/plans) and apply it.");
      return;
    }
    $("plan-title").textContent = "#" + plan.id + " · " + plan.status +
      (plan.applied_at ? " " + H.clock(Date.parse(plan.applied_at) / 1000, false) : "");
    const rate = finite(plan.rate_qps) ? plan.rate_qps : plan.planned_rate_qps;
    const lat = snap.latency;  // the SLO and its percentile, read from the spec
    const head = el("p", { class: "plan-head" }, [
      el("span", { class: "tag" + (plan.feasible ? "" : " no"), text: plan.feasible ? "feasible" : "infeasible" }),
      document.createTextNode(fleetText(plan.fleet) + " · " + usd(plan.cost_usd_per_hr, 3) + "/hr · planned for " +
        qps(rate) + (finite(plan.max_feasible_qps) ? " (at most " + qps(plan.max_feasible_qps) + ")" : "") + " · "),
      el("span", {
        class: "plan-predicted",
        title: "the estimator's end-to-end P" + lat.percentile + " of the whole pipeline at the planned rate",
        text: "predicted end-to-end P" + lat.percentile + " " +
          (finite(plan.predicted_p99_ms) ? ms(plan.predicted_p99_ms) : "– (not in this plan)") +
          (finite(lat.slo_ms) ? " (SLO " + ms(lat.slo_ms) + ")" : ""),
      }),
      document.createTextNode(plan.trace && plan.trace.source ? " · trace: " + plan.trace.source : ""),
    ]);
    const stages = table(
      [["stage"], ["fleet", "mix"], ["batch", "num"], ["P99 (sim.)", "num"], ["qps", "num"], ["$/hr", "num"]],
      plan.stages.map((s) => [s.name, fleetText(s.fleet), String(s.batch_size ?? "–"), ms(s.predicted_p99_ms),
        finite(s.throughput_qps) ? s.throughput_qps.toFixed(1) : "–", usd(s.cost_usd_per_hr, 3)]),
    );
    // Folded parts keep the reader's choice across polls (the panel is rebuilt every 2 s).
    const opened = new Map([...body.querySelectorAll("details[data-keep]")].map((d) => [d.dataset.keep, d.open]));
    const fold = (key, summary, children, open) => {
      const node = el("details", { class: key.startsWith("why:") ? "stage-why" : "steps", "data-keep": key },
        [el("summary", { text: summary }), ...children]);
      node.open = opened.has(key) ? opened.get(key) : open;
      return node;
    };
    const why = [];
    const ranking = plan.ranking || {};
    const stagesRanked = ranking.stages || [];
    stagesRanked.forEach((stage, index) => {
      const chosen = stage.chosen || {};
      const parts = [];
      const words = "Applied: " + fleetText(chosen.fleet) + ", Kairos bound " + qps(chosen.upper_bound_qps) +
        ", " + usd(chosen.cost_usd_per_hr, 3) + "/hr. " +
        (stage.ranked ? stage.ranked.toLocaleString() + " mixes within " + usd(ranking.budget_usd_per_hr, 2) + "/hr ranked on " + ranking.batch_mix + "." : "") +
        (stage.note && !stage.ranked ? " " + stage.note : "");
      parts.push(el("p", { class: "note", text: words }));
      if (stage.covering && stage.covering.length) {
        parts.push(el("p", { class: "note", text: "The cheapest mixes whose bound × " + ranking.headroom + " covers the peak " + qps(stage.peak_qps) + ": the planner starts from the first, then adds and cuts with the simulator (its steps):" }));
        parts.push(table([["mix", "mix"], ["bound", "num"], ["$/hr", "num"]],
          stage.covering.map((m) => [fleetText(m.fleet), qps(m.upper_bound_qps), usd(m.cost_usd_per_hr, 3)]),
          (i) => (stage.covering[i].chosen ? "chosen" : "")));
      }
      if (stage.top && stage.top.length) {
        parts.push(fold("head:" + stage.stage, "The ranking's head: the highest bounds within the budget", [
          table([["#", "num"], ["mix", "mix"], ["bound", "num"], ["$/hr", "num"]],
            stage.top.map((m, i) => [String(i + 1), fleetText(m.fleet), qps(m.upper_bound_qps), usd(m.cost_usd_per_hr, 3)]),
            (i) => (stage.top[i].chosen ? "chosen" : "")),
        ], false));
      }
      const title = "Why this mix" + (stagesRanked.length > 1 ? ": stage " + stage.stage : "");
      // The first stage open, the others a click away.
      why.push(fold("why:" + stage.stage, title, parts, index === 0));
    });
    if (!why.length && ranking.note) why.push(el("p", { class: "note", text: ranking.note }));
    const steps = fold("steps", "The planner's " + plan.steps.length + " steps (" + (plan.simulations ?? 0) + " simulations)",
      [el("ol", {}, plan.steps.map((s) => el("li", { text: s })))], false);
    body.replaceChildren(head, el("div", { class: "plan-cols" }, [
      el("div", {}, [el("h3", { text: "Stages" }), stages, steps]),
      el("div", { id: "plan-ranking" }, why),
    ]));
    setPanel("plan", "ready");
  }

  // --- polling ------------------------------------------------------------------------------

  // The app's rollout (docs/rollouts.md): its state, step, reason and the figures per version.
  function renderRollout(snap) {
    const r = snap.rollout;
    const body = $("rollout-body");
    if (!r) {
      body.replaceChildren();
      $("rollout-title").textContent = "";
      setPanel("rollout", "empty", "No rollout: heteroplane rollout start --app " + snap.app.name + " --model NAME@VERSION.");
      return;
    }
    $("rollout-title").textContent = "#" + r.id;
    const share = r.shadow_step ? "shadow: every query mirrored" : pct(r.step_share) + " of queries on the new version";
    const steps = (r.steps || []).map((s) => (s === 0 ? "shadow" : pct(s))).join(" → ");
    const head = el("p", { class: "rollout-head" }, [
      el("b", { class: "rollout-state " + r.state, text: r.state.replace(/_/g, " ") }),
      // A pending rollout's phase: profiling, waiting for budget, starting.
      document.createTextNode(r.phase ? " (" + r.phase.replace(/_/g, " ") + ")" : ""),
      document.createTextNode(" " + r.model + ": " + r.artifact + "@" + r.from_version + " → @" + r.to_version + ", " + share),
    ]);
    const stepLine = el("p", { class: "note", text: "steps " + steps + " (step " + (Math.min(r.step_index, r.steps.length - 1) + 1) + " of " + r.steps.length + ", at least " + duration(r.interval_s) + " each)" });
    const reason = el("p", { class: "rollout-reason", text: r.reason });
    const versions = Object.entries((r.figures || {}).versions || {}).sort((a, b) => (a[0] < b[0] ? -1 : 1));
    const rows = versions.map(([v, f]) => [
      v, String(f.queries), String(f.errors), ms(f.p99_ms),
      finite(f.agreement_share) ? pct(f.agreement_share) + " of " + f.compared : "–",
      finite(f.accuracy) ? pct(f.accuracy) + " of " + f.labelled : "–",
    ]);
    const figures = rows.length
      ? table([["version"], ["queries", "num"], ["errors", "num"], ["P99", "num"], ["agreement", "num"], ["accuracy", "num"]], rows)
      : el("p", { class: "note", text: "No figures for this step yet: they appear once queries reach the new version." });
    body.replaceChildren(head, stepLine, reason, figures);
    setPanel("rollout", rows.length ? "ready" : "partial", rows.length ? "" : "");
  }

  // The app select: the apps by name; with no app on screen, a blank first option to pick from.
  function renderApps(apps, current) {
    const select = $("app-select");
    const wanted = current ? apps : ["", ...apps];
    const options = [...select.options].map((o) => o.value);
    if (options.join(",") !== wanted.join(",")) {
      select.replaceChildren(...wanted.map((a) => el("option", { value: a, text: a || "pick an app" })));
    }
    select.value = current || "";
  }

  // No app on screen: every tile, table, log, chart and plan as a fresh page has them, so that
  // nothing of an app that is gone stays on the page.
  function clearPanels(message) {
    for (const node of document.querySelectorAll(".tile")) {
      tile(node.id, "–", "");
      node.title = "";
    }
    for (const id of ["fleet-chart", "fleet-legend", "cost-chart", "cost-legend", "cost-figures",
      "load-chart", "load-legend", "envelope-chart", "latency-chart", "latency-legend",
      "attainment-chart", "gear-chart", "accuracy-chart", "cascade-legend", "decision-log",
      "plan-body", "rollout-body"]) $(id).replaceChildren();
    $("instance-table").querySelector("tbody").replaceChildren();
    for (const id of ["envelope-note", "decision-count", "plan-title", "rollout-title"]) $(id).textContent = "";
    for (const panel of document.querySelectorAll("[data-panel]")) setPanel(panel.dataset.panel, "empty", message);
    state.lastSnap = null;
    state.seenDecisions = null;
    delete document.body.dataset.generatedAt;
  }

  function render(body) {
    state.lastBody = body;
    $("viewer").textContent = body.viewer.name + " (" + body.viewer.scope + ")";
    if (state.gone && body.apps.includes(state.app)) {
      // The app is back (registered again under its name): the next poll asks for it (this
      // answer is the default app's).
      state.gone = false;
      state.drawn = false;
      return;
    }
    const snap = state.gone ? null : body.snapshot;
    renderApps(body.apps, snap ? snap.app.name : null);
    const noApps = "No apps yet: register one (POST /v1/apps, or heteroplane app apply -f app.yaml).";
    if (!snap) {
      clearPanels(state.gone ? "No app shown." : "No apps yet.");
      showBanner(state.gone
        ? "The app '" + state.app + "' is gone (taken down or deleted): " + (body.apps.length ? "pick another app above." : noApps)
        : noApps);
      return;
    }
    if (state.app !== snap.app.name) {
      // The data route's default app, drawn: the page stays on it (and says so in its address).
      state.app = snap.app.name;
      remember();
    }
    state.drawn = true;
    showBanner(state.notice);
    const parts = [renderFleet, renderCost, renderLoad, renderLatency, renderCascade, renderDecisions, renderPlan, renderRollout];
    for (const part of parts) {
      try {
        part(snap);
      } catch (error) {
        console.error(part.name, error);
      }
    }
    document.body.dataset.generatedAt = snap.generated_at;
  }

  function showBanner(message) {
    const banner = $("banner");
    banner.hidden = !message;
    banner.textContent = message || "";
  }

  function setStatus(text, tone) {
    const status = $("status");
    status.textContent = text;
    status.className = "status " + (tone || "");
  }

  async function poll() {
    clearTimeout(state.timer);
    const url = new URL("/dashboard/data", window.location.origin);
    if (state.app && !state.gone) url.searchParams.set("app", state.app);
    url.searchParams.set("window_s", String(state.windowS));
    // Only the newest request's answer is drawn: one for the app or window the operator just
    // left would otherwise pin the page back on it.
    const request = ++state.requests;
    try {
      const response = await fetch(url, { credentials: "same-origin", cache: "no-store", headers: { Accept: "application/json" } });
      if (request !== state.requests) return;
      if (response.status === 401) {
        // Signed out elsewhere, expired or revoked: the form says so (in every tab, whether or
        // not the browser still sends the cookie) and signs in again to this app and window.
        const back = new URLSearchParams(window.location.search);
        back.set("ended", "1");
        window.location.assign("/dashboard?" + back.toString());
        return;
      }
      const body = await response.json();
      if (request !== state.requests) return;
      if (!response.ok) {
        const message = body && body.error ? body.error.message : response.statusText;
        showBanner(message);
        setStatus("error " + response.status, "stale");
        if ((response.status === 404 || response.status === 422) && state.app && !state.gone) {
          if (state.drawn) {
            // The app on screen is gone: say so until the operator picks another (the polls
            // then ask for the default app only for the list of apps).
            state.gone = true;
          } else {
            // An app from the address that is not there: drop it and show the first app.
            state.notice = "There is no app '" + state.app + "': showing the first app.";
            state.app = null;
            remember();
          }
          state.timer = setTimeout(poll, 0);
          return;
        }
      } else {
        render(body);
        state.failures = 0;
        setStatus("live · " + H.clock(Date.now() / 1000, true), "live");
      }
    } catch (error) {
      if (request !== state.requests) return;
      state.failures += 1;
      setStatus("cannot reach the service (" + state.failures + ")", "stale");
    }
    state.timer = setTimeout(poll, POLL_MS);
  }

  function remember() {
    const query = new URLSearchParams();
    if (state.app) query.set("app", state.app);
    if (state.windowS !== DEFAULT_WINDOW_S) query.set("window_s", String(state.windowS));
    if (state.decisionKind) query.set("kind", state.decisionKind);
    const suffix = query.toString();
    window.history.replaceState(null, "", "/dashboard" + (suffix ? "?" + suffix : ""));
  }

  $("app-select").addEventListener("change", (event) => {
    if (!event.target.value) return;
    state.app = event.target.value;
    state.gone = false;
    state.drawn = false;
    state.notice = null;
    state.seenDecisions = null;
    remember();
    poll();
  });
  const windowSelect = $("window-select");
  if (![...windowSelect.options].some((o) => Number(o.value) === state.windowS)) {
    // A window from the address that the list does not offer (within the data route's bounds):
    // offer it too.
    windowSelect.appendChild(el("option", { value: String(state.windowS), text: windowLabel(state.windowS) }));
  }
  windowSelect.value = String(state.windowS);
  windowSelect.addEventListener("change", (event) => {
    state.windowS = Number(event.target.value);
    state.notice = null;
    remember();
    poll();
  });
  if (state.notice) remember();
  let resizing = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizing);
    resizing = setTimeout(() => {
      if (state.lastBody) render(state.lastBody);
    }, 150);
  });
  poll();
})();
