/*
 * Hand-drawn SVG charts for the heteroplane dashboard (no library, no build step).
 *
 * HPCharts.time(el, spec)    lines and step lines over time, with horizontal reference lines
 * HPCharts.stack(el, spec)   stacked step areas over time (the fleet by instance type)
 * HPCharts.lane(el, spec)    a categorical band over time (the cascade's gear)
 * HPCharts.xy(el, spec)      lines over a numeric x axis, linear or log (the arrival envelope)
 * HPCharts.legend(el, items) a legend of swatches
 *
 * Times are epoch seconds. A value of null breaks a line. Every text is set with textContent,
 * never parsed as markup. The SVG is as wide as its container (re-drawn on resize).
 */
(function () {
  "use strict";

  const NS = "http://www.w3.org/2000/svg";
  const PALETTE = [
    "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2",
    "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac",
  ];
  const MARGIN = { l: 46, r: 12, t: 8, b: 18 };

  function svgEl(name, attrs, parent) {
    const node = document.createElementNS(NS, name);
    for (const [key, value] of Object.entries(attrs || {})) {
      node.setAttribute(key, String(value));
    }
    if (parent) parent.appendChild(node);
    return node;
  }

  function text(parent, x, y, content, attrs) {
    const node = svgEl("text", Object.assign({ x: x, y: y }, attrs || {}), parent);
    node.textContent = content;
    return node;
  }

  function niceStep(range, ticks) {
    const raw = range / Math.max(1, ticks);
    const power = Math.pow(10, Math.floor(Math.log10(raw)));
    const fraction = raw / power;
    const nice = fraction <= 1 ? 1 : fraction <= 2 ? 2 : fraction <= 2.5 ? 2.5 : fraction <= 5 ? 5 : 10;
    return nice * power;
  }

  function finite(value) {
    return typeof value === "number" && Number.isFinite(value);
  }

  function yDomain(values, spec) {
    let lo = spec.yMin !== undefined ? spec.yMin : Infinity;
    let hi = spec.yMax !== undefined ? spec.yMax : -Infinity;
    if (spec.yMin === undefined || spec.yMax === undefined) {
      for (const v of values) {
        if (!finite(v)) continue;
        if (spec.yMin === undefined) lo = Math.min(lo, v);
        if (spec.yMax === undefined) hi = Math.max(hi, v);
      }
    }
    if (!Number.isFinite(lo)) lo = 0;
    if (!Number.isFinite(hi)) hi = lo + 1;
    if (spec.yMax === undefined) hi = hi + (hi - lo) * 0.08;
    if (hi <= lo) {
      // A flat series: open a span, on the side that is not fixed (an accuracy of 1.0 under a
      // fixed top of 100% lowers the bottom, never lifts the top).
      if (spec.yMax !== undefined && spec.yMin === undefined) lo = hi - (Math.abs(hi) * 0.1 || 1);
      else hi = lo + 1;
    }
    const step = niceStep(hi - lo, spec.yTicks || 4);
    if (spec.yMax === undefined) hi = Math.ceil(hi / step - 1e-9) * step;
    if (spec.yMin === undefined) lo = Math.floor(lo / step + 1e-9) * step;
    return { lo: lo, hi: hi, step: step };
  }

  const TIME_STEPS = [5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200];

  function two(n) {
    return String(n).padStart(2, "0");
  }

  function clock(seconds, withSeconds) {
    const d = new Date(seconds * 1000);
    const hm = two(d.getHours()) + ":" + two(d.getMinutes());
    return withSeconds ? hm + ":" + two(d.getSeconds()) : hm;
  }

  function frame(el, spec) {
    const width = Math.max(240, Math.round(el.clientWidth || 400));
    const height = spec.height || 140;
    const svg = svgEl("svg", {
      viewBox: "0 0 " + width + " " + height,
      height: height,
      role: "img",
      "aria-label": spec.title || "chart",
    });
    const m = Object.assign({}, MARGIN, spec.margin || {});
    return { svg: svg, w: width, h: height, m: m, iw: width - m.l - m.r, ih: height - m.t - m.b };
  }

  function yAxis(f, dom, format) {
    const grid = svgEl("g", { class: "grid" }, f.svg);
    for (let v = dom.lo; v <= dom.hi + dom.step * 1e-6; v += dom.step) {
      const y = f.m.t + f.ih - ((v - dom.lo) / (dom.hi - dom.lo)) * f.ih;
      svgEl("line", { x1: f.m.l, x2: f.m.l + f.iw, y1: y, y2: y, stroke: "#eceef1" }, grid);
      text(grid, f.m.l - 4, y + 3, format(v), { "text-anchor": "end" });
    }
  }

  function timeAxis(f, t0, t1) {
    const span = Math.max(1, t1 - t0);
    const step = TIME_STEPS.find((s) => span / s <= Math.max(2, Math.floor(f.iw / 70))) || 86400;
    const g = svgEl("g", { class: "axis" }, f.svg);
    svgEl("line", { x1: f.m.l, x2: f.m.l + f.iw, y1: f.m.t + f.ih, y2: f.m.t + f.ih, stroke: "#c4c9d1" }, g);
    const offset = new Date(t0 * 1000).getTimezoneOffset() * 60;
    let first = Math.ceil((t0 - offset) / step) * step + offset;
    for (let t = first; t <= t1; t += step) {
      const x = f.m.l + ((t - t0) / span) * f.iw;
      svgEl("line", { x1: x, x2: x, y1: f.m.t + f.ih, y2: f.m.t + f.ih + 3, stroke: "#c4c9d1" }, g);
      text(g, x, f.m.t + f.ih + 13, clock(t, step < 60), { "text-anchor": "middle" });
    }
  }

  function scaler(f, t0, t1, dom) {
    const span = Math.max(1e-9, t1 - t0);
    return {
      x: (t) => f.m.l + ((t - t0) / span) * f.iw,
      y: (v) => f.m.t + f.ih - ((Math.min(Math.max(v, dom.lo), dom.hi) - dom.lo) / (dom.hi - dom.lo)) * f.ih,
    };
  }

  /* A path through (t[i], v[i]); steps hold each value until the next time; null breaks it. */
  function linePath(s, t, v, step, tEnd) {
    let d = "";
    let open = false;
    for (let i = 0; i < t.length; i++) {
      if (!finite(v[i]) || !finite(t[i])) {
        open = false;
        continue;
      }
      const x = s.x(t[i]);
      const y = s.y(v[i]);
      if (!open) {
        d += "M" + x.toFixed(1) + " " + y.toFixed(1);
        open = true;
      } else {
        d += (step ? "H" + x.toFixed(1) + "V" + y.toFixed(1) : "L" + x.toFixed(1) + " " + y.toFixed(1));
      }
      if (step && (i === t.length - 1 || !finite(v[i + 1]))) {
        const next = i === t.length - 1 ? tEnd : t[i + 1];
        if (finite(next)) d += "H" + s.x(next).toFixed(1);
      }
    }
    return d;
  }

  function draw(el, f) {
    el.replaceChildren(f.svg);
  }

  /*
   * spec: {t0, t1, height, yMin, yMax, yFormat, series: [{label, color, t, v, step, dash,
   * width, fill}], hlines: [{value, label, color, dash}]}
   */
  function time(el, spec) {
    const f = frame(el, spec);
    const values = [];
    for (const s of spec.series) values.push(...s.v);
    for (const h of spec.hlines || []) values.push(h.value);
    const dom = yDomain(values, spec);
    const format = spec.yFormat || ((v) => String(+v.toFixed(2)));
    yAxis(f, dom, format);
    timeAxis(f, spec.t0, spec.t1);
    const s = scaler(f, spec.t0, spec.t1, dom);
    spec.series.forEach((series, i) => {
      const color = series.color || PALETTE[i % PALETTE.length];
      const d = linePath(s, series.t, series.v, series.step, spec.t1);
      if (!d) return;
      if (series.fill) {
        const first = series.t.findIndex((t, j) => finite(series.v[j]));
        const area = d + "V" + (f.m.t + f.ih) + "H" + s.x(series.t[first]).toFixed(1) + "Z";
        svgEl("path", { d: area, fill: color, "fill-opacity": 0.12, stroke: "none" }, f.svg);
      }
      svgEl("path", {
        d: d,
        fill: "none",
        stroke: color,
        "stroke-width": series.width || 1.8,
        "stroke-dasharray": series.dash || "none",
        "stroke-linejoin": "round",
        "data-series": series.label,
      }, f.svg);
    });
    for (const h of spec.hlines || []) {
      if (!finite(h.value)) continue;
      const y = s.y(h.value);
      svgEl("line", {
        x1: f.m.l, x2: f.m.l + f.iw, y1: y, y2: y,
        stroke: h.color || "#d62728", "stroke-width": 1.4, "stroke-dasharray": h.dash || "5 4",
        "data-series": h.label,
      }, f.svg);
      if (h.label) {
        text(f.svg, f.m.l + f.iw - 2, y - 3, h.label, {
          "text-anchor": "end", class: "label-line", fill: h.color || "#d62728",
        });
      }
    }
    draw(el, f);
  }

  /* spec: {t0, t1, t, layers: [{label, color, v}], height, yFormat} (step areas, stacked) */
  function stack(el, spec) {
    const f = frame(el, spec);
    const totals = spec.t.map((_, i) => spec.layers.reduce((sum, layer) => sum + (layer.v[i] || 0), 0));
    const dom = yDomain(totals.concat([1]), Object.assign({ yMin: 0 }, spec));
    if (dom.step < 1) {
      dom.step = 1;
      dom.hi = Math.max(1, Math.ceil(dom.hi));
    }
    yAxis(f, dom, spec.yFormat || ((v) => String(Math.round(v))));
    timeAxis(f, spec.t0, spec.t1);
    const s = scaler(f, spec.t0, spec.t1, dom);
    const base = spec.t.map(() => 0);
    spec.layers.forEach((layer, li) => {
      const color = layer.color || PALETTE[li % PALETTE.length];
      const top = base.map((b, i) => b + (layer.v[i] || 0));
      let d = "";
      for (let i = 0; i < spec.t.length; i++) {
        const x0 = s.x(Math.max(spec.t[i], spec.t0));
        const x1 = s.x(i + 1 < spec.t.length ? spec.t[i + 1] : spec.t1);
        d += (i === 0 ? "M" : "L") + x0.toFixed(1) + " " + s.y(top[i]).toFixed(1);
        d += "L" + x1.toFixed(1) + " " + s.y(top[i]).toFixed(1);
      }
      for (let i = spec.t.length - 1; i >= 0; i--) {
        const x0 = s.x(Math.max(spec.t[i], spec.t0));
        const x1 = s.x(i + 1 < spec.t.length ? spec.t[i + 1] : spec.t1);
        d += "L" + x1.toFixed(1) + " " + s.y(base[i]).toFixed(1);
        d += "L" + x0.toFixed(1) + " " + s.y(base[i]).toFixed(1);
      }
      d += "Z";
      svgEl("path", {
        d: d, fill: color, "fill-opacity": 0.85, stroke: color, "stroke-width": 0.5,
        "data-series": layer.label,
      }, f.svg);
      for (let i = 0; i < base.length; i++) base[i] = top[i];
    });
    draw(el, f);
  }

  /* spec: {t0, t1, t, values (labels or null), colors: {label: color}, height} */
  function lane(el, spec) {
    const f = frame(el, Object.assign({ height: 24, margin: { t: 2, b: 2 } }, spec));
    const s = scaler(f, spec.t0, spec.t1, { lo: 0, hi: 1, step: 1 });
    text(f.svg, f.m.l - 4, f.m.t + f.ih / 2 + 3, spec.label || "gear", { "text-anchor": "end" });
    svgEl("rect", { x: f.m.l, y: f.m.t, width: f.iw, height: f.ih, fill: "#f3f4f6" }, f.svg);
    let i = 0;
    while (i < spec.t.length) {
      const value = spec.values[i];
      let j = i + 1;
      while (j < spec.t.length && spec.values[j] === value) j++;
      if (value !== null && value !== undefined) {
        const x0 = s.x(Math.max(spec.t[i], spec.t0));
        const x1 = s.x(j < spec.t.length ? spec.t[j] : spec.t1);
        const color = (spec.colors || {})[value] || "#888";
        svgEl("rect", {
          x: x0, y: f.m.t, width: Math.max(1, x1 - x0), height: f.ih, fill: color,
          "data-series": value,
        }, f.svg);
        if (x1 - x0 > 7 * String(value).length + 6) {
          text(f.svg, (x0 + x1) / 2, f.m.t + f.ih / 2 + 3.5, value, {
            "text-anchor": "middle", class: "gear-text",
          });
        }
      }
      i = j;
    }
    draw(el, f);
  }

  /* spec: {x0, x1, xLog, xFormat, series: [{label, color, x, y, dash}], height, yFormat} */
  function xy(el, spec) {
    const f = frame(el, spec);
    const values = [];
    for (const s of spec.series) values.push(...s.y);
    const dom = yDomain(values, Object.assign({ yMin: 0 }, spec));
    yAxis(f, dom, spec.yFormat || ((v) => String(+v.toFixed(1))));
    const tx = (x) => (spec.xLog ? Math.log10(x) : x);
    const lo = tx(spec.x0);
    const hi = tx(spec.x1);
    const sx = (x) => f.m.l + ((tx(x) - lo) / Math.max(1e-9, hi - lo)) * f.iw;
    const sy = (v) => f.m.t + f.ih - ((v - dom.lo) / (dom.hi - dom.lo)) * f.ih;
    const g = svgEl("g", { class: "axis" }, f.svg);
    svgEl("line", { x1: f.m.l, x2: f.m.l + f.iw, y1: f.m.t + f.ih, y2: f.m.t + f.ih, stroke: "#c4c9d1" }, g);
    for (const x of spec.xTicks || []) {
      text(g, sx(x), f.m.t + f.ih + 13, (spec.xFormat || String)(x), { "text-anchor": "middle" });
    }
    spec.series.forEach((series, i) => {
      let d = "";
      let open = false;
      for (let k = 0; k < series.x.length; k++) {
        if (!finite(series.y[k])) {
          open = false;
          continue;
        }
        d += (open ? "L" : "M") + sx(series.x[k]).toFixed(1) + " " + sy(series.y[k]).toFixed(1);
        open = true;
      }
      if (!d) return;
      svgEl("path", {
        d: d, fill: "none", stroke: series.color || PALETTE[i % PALETTE.length],
        "stroke-width": 1.8, "stroke-dasharray": series.dash || "none", "data-series": series.label,
      }, f.svg);
    });
    draw(el, f);
  }

  /* items: [{label, color, kind: "area" | "line" | "dash"}] */
  function legend(el, items) {
    const nodes = items.map((item) => {
      const span = document.createElement("span");
      const swatch = document.createElement("i");
      swatch.className = "swatch " + (item.kind || "area");
      if (item.kind === "dash") swatch.style.borderColor = item.color;
      else swatch.style.background = item.color;
      span.appendChild(swatch);
      span.appendChild(document.createTextNode(item.label));
      return span;
    });
    el.replaceChildren(...nodes);
  }

  window.HPCharts = { time, stack, lane, xy, legend, PALETTE, clock };
})();
