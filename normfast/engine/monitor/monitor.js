/* normfast view of a training monitor folder: the page's script, after the family's helpers
   (common.js, the global NF). Reads the data from the JSON element #nf-data (written by
   normfast.engine.monitor.page). */
(function () {
  "use strict";
  var DATA = JSON.parse(document.getElementById("nf-data").textContent);
  var fmt = NF.fmt, esc = NF.esc, el = NF.el, svg = NF.svg, axis = NF.axis, frame = NF.frame;
  var S = DATA.series, T = DATA.items, X = DATA.steps.x, W0 = DATA.window;
  var PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2",
                 "#bcbd22", "#7f7f7f"];
  var chosen = [], colorOf = {};
  var seriesOfId = {};
  S.id.forEach(function (id, si) { seriesOfId[id] = si; });

  // ---------------------------------------------------------------- the chosen items
  function color(si) { return colorOf[si]; }
  function choose(si, on) {
    var at = chosen.indexOf(si);
    if (on && at < 0) {
      var used = chosen.map(color);
      colorOf[si] = PALETTE.filter(function (c) { return used.indexOf(c) < 0; })[0] || PALETTE[chosen.length % 10];
      chosen.push(si);
    } else if (!on && at >= 0) {
      chosen.splice(at, 1);
    }
  }
  function drawChosen() {
    el("nf-chosen").innerHTML = chosen.map(function (si) {
      return '<span class="nf-pick" data-series="' + si + '">' + NF.chipText(color(si), S.id[si]) +
        ' <button type="button" title="stop plotting this item" data-drop="' + si + '">×</button></span>';
    }).join("") || '<span class="nf-status">none: tick items in the table, or add one by id</span>';
    var list = el("nf-ids");
    if (!list.childNodes.length) {
      list.innerHTML = S.id.map(function (id) { return '<option value="' + esc(id) + '">'; }).join("");
    }
  }
  function redraw() {
    drawChosen();
    drawNorms();
    if (DATA.terms) { budgetChoices(); drawBudget(); drawLaw(); }
    if (table) table.refresh();
  }
  el("nf-chosen").addEventListener("click", function (ev) {
    var b = ev.target.closest("button[data-drop]");
    if (b) { choose(+b.dataset.drop, false); redraw(); }
  });
  el("nf-add").addEventListener("change", function (ev) {
    var si = seriesOfId[ev.target.value];
    if (si !== undefined) { choose(si, true); ev.target.value = ""; redraw(); }
  });

  // ---------------------------------------------------------------- norms and R_eq over training
  function xAxis(box) {
    var xr = NF.xRange(box);
    return axis(X[0], X[X.length - 1], false, xr[0], xr[1]);
  }
  function windowBand(box, xa) {
    var yr = NF.yRange(box), a = xa.map(W0.first_step), b = xa.map(W0.last_step);
    var band = svg(box, "rect", { x: a, y: yr[1], width: Math.max(1, b - a), height: yr[0] - yr[1], fill: "#f0f1f4" });
    box.insertBefore(band, box.querySelector(".nf-axis"));  // under the grid and the lines
  }
  function pixels(xa, ya, values) {
    return values.map(function (v, k) {
      return v === null || !isFinite(v) || (ya.log && !(v > 0)) ? null : [xa.map(X[k]), ya.map(v)];
    });
  }
  function drawNorms() {
    var box = el("nf-fig-norms"), cap = el("nf-cap-norms"), norms = [];
    chosen.forEach(function (si) { norms = norms.concat(NF.finite(S.norm[si])); });
    var ext = NF.extent(norms), span = Math.max(ext[1] - ext[0], Math.abs(ext[1]) * 0.05, 1e-12);
    // R_eq points far outside the norms' range are left out (counted in the caption), not squeezed in
    var lo = ext[0] - span, hi = ext[1] + span, outside = 0, extra = [];
    var laws = {};
    ["r_eq", "virtual_r_eq"].forEach(function (key) {
      if (!S[key]) return;
      chosen.forEach(function (si) {
        laws[key + si] = S[key][si].map(function (v) {
          if (v === null) return null;
          if (v < lo || v > hi) { outside++; return null; }
          extra.push(v);
          return v;
        });
      });
    });
    var all = NF.extent(norms.concat(extra)), xa = xAxis(box), yr = NF.yRange(box);
    var ya = axis(Math.max(0, all[0]), all[1], false, yr[0], yr[1]);
    frame(box, chosen.length ? "Norm R over training, " + chosen.length + " item" + (chosen.length > 1 ? "s" : "") +
          (DATA.terms ? ", with the law's R_eq (dashed)" : "") : "Norm R over training: no item chosen",
          "training step", "norm R", xa, ya);
    windowBand(box, xa);
    chosen.forEach(function (si) {
      var p = NF.line(box, pixels(xa, ya, S.norm[si]), color(si), 1.6);
      if (p) svg(p, "title", {}, S.id[si] + ": norm");
      if (S.r_eq) NF.line(box, pixels(xa, ya, laws["r_eq" + si]), color(si), 1.4, "5 3");
      if (S.virtual_r_eq) NF.line(box, pixels(xa, ya, laws["virtual_r_eq" + si]), color(si), 1.2, "1.5 2.5");
    });
    var parts = ["solid: the norm R at each recorded step"];
    if (S.r_eq) {
      parts.push("dashed: R_eq, the law from the realized terms averaged over the " + W0.recorded_steps +
                 " recorded steps up to each step (drawn from the first step with that many before it)");
    }
    if (S.virtual_r_eq) parts.push("dotted: the virtual probe's r_eq at that state alone");
    parts.push("grey band: the window (steps " + W0.first_step + "-" + W0.last_step + ")");
    if (DATA.steps.bin > 1) parts.push("each point the mean over " + DATA.steps.bin + " consecutive recorded steps");
    if (outside) parts.push(outside + " R_eq points beyond the norms' range not drawn");
    cap.textContent = parts.join("; ") + ".";
  }

  // ---------------------------------------------------------------- the budget over training
  var TERMS = [["task", "task (task1 + task2)", "#2166ac", 1.5], ["decay", "decay", "#b2182b", 1.5],
               ["remainder", "remainder (curvature)", "#8a9097", 1.2]], SUM = "#e08214";
  function budgetChoices() {
    var sel = el("nf-budget-of"), keep = sel.value;
    sel.innerHTML = '<option value="all">the mean over all ' + DATA.n_items.toLocaleString() + " items</option>" +
      chosen.map(function (si) { return '<option value="' + si + '">item ' + esc(S.id[si]) + "</option>"; }).join("");
    sel.value = keep && (keep === "all" || chosen.indexOf(+keep) >= 0) ? keep : "all";
  }
  function budgetSeries(which) {
    var out = {};
    TERMS.forEach(function (t) { out[t[0]] = which === "all" ? DATA.mean_terms[t[0]] : S[t[0]][+which]; });
    out.sum = out.task.map(function (v, k) {
      var d = out.decay[k], r = out.remainder[k];
      return v === null || d === null || r === null ? null : v + d + r;
    });
    return out;
  }
  function drawBudget() {
    var box = el("nf-fig-budget"), which = el("nf-budget-of").value, b = budgetSeries(which);
    var values = b.sum.slice();
    TERMS.forEach(function (t) { values = values.concat(b[t[0]]); });
    // the middle 98% of the points set the vertical range: a few spiky steps would flatten every
    // other step into the zero line; what reaches past it is cut at the frame, and counted
    var sorted = NF.finite(values).sort(function (u, v) { return u - v; });
    var lo = Math.min(0, NF.quantile(sorted, 0.01)), hi = Math.max(0, NF.quantile(sorted, 0.99));
    if (!(hi > lo)) { lo = Math.min(0, sorted[0] || 0); hi = Math.max(0, sorted[sorted.length - 1] || 1); }
    var cut = sorted.filter(function (v) { return v < lo || v > hi; }).length;
    var xa = xAxis(box), yr = NF.yRange(box), ya = axis(lo, hi, false, yr[0], yr[1]);
    var who = which === "all" ? "the mean over all items" : "item " + S.id[+which];
    frame(box, "Where R² goes each step: " + who, "training step", "change of R² per step", xa, ya);
    windowBand(box, xa);
    var inside = NF.area(box);
    NF.line(inside, [[xa.map(X[0]), ya.map(0)], [xa.map(X[X.length - 1]), ya.map(0)]], "#555", 0.8);
    TERMS.forEach(function (t) { NF.line(inside, pixels(xa, ya, b[t[0]]), t[2], t[3]); });
    NF.line(inside, pixels(xa, ya, b.sum), SUM, 1.2, "4 2");
    el("nf-cap-budget").innerHTML = TERMS.map(function (t) { return NF.chipText(t[2], t[1]); }).join(" &nbsp; ") +
      " &nbsp; " + NF.chipText(SUM, "their sum, the realized ΔR² (dashed)") + ". Grey band: the window" +
      (DATA.steps.bin > 1 ? "; each point the mean over " + DATA.steps.bin + " consecutive recorded steps" : "") +
      (cut ? "; the vertical range holds 98% of the points, " + cut + " beyond it are cut at the frame." : ".");
  }
  if (DATA.terms) el("nf-budget-of").addEventListener("change", drawBudget);

  // ---------------------------------------------------------------- every item: the law against its norm
  function drawLaw() {
    var box = el("nf-fig-law"), cap = el("nf-cap-law"), obs = T.q.observed.mean, law = T.q.r_eq_realized;
    var se = T.q.observed.se, pts = [], mine = [];
    for (var i = 0; i < T.n; i++) {
      var x = law ? law.mean[i] : null, y = obs[i];
      if (!(x > 0) || !(y > 0)) continue;
      pts.push([x, y, se ? se[i] : null]);
      if (T.series[i] >= 0 && chosen.indexOf(T.series[i]) >= 0) mine.push([x, y, T.series[i]]);
    }
    var xr = NF.xRange(box), yr = NF.yRange(box);
    if (!pts.length) {
      frame(box, "No item has a prediction from the realized terms", "R_eq", "norm", axis(1, 10, true, xr[0], xr[1]),
            axis(1, 10, true, yr[0], yr[1]));
      cap.textContent = "The law needs weight decay on the monitored parameters and the realized terms.";
      return;
    }
    var xs = pts.map(function (p) { return p[0]; }), ys = pts.map(function (p) { return p[1]; });
    var both = NF.extent(xs.concat(ys));
    var xa = axis(both[0], both[1], true, xr[0], xr[1]), ya = axis(both[0], both[1], true, yr[0], yr[1]);
    frame(box, "Window-mean norm vs the law, " + pts.length + " items", "R_eq from the realized window means (log)",
          "window-mean norm (log)", xa, ya);
    NF.line(box, [[xa.map(both[0]), ya.map(both[0])], [xa.map(both[1]), ya.map(both[1])]], "#999", 1, "4 3");
    NF.bars(NF.area(box), pts.filter(function (p) { return p[2] > 0; }).map(function (p) {
      return [xa.map(p[0]), ya.map(Math.max(p[1] - p[2], Math.pow(10, ya.lo))), ya.map(p[1] + p[2])];
    }), "#7a8591", 0.35);
    NF.dots(box, pts.map(function (p) { return [xa.map(p[0]), ya.map(p[1])]; }), "#7a8591", 3.6, 0.7);
    mine.forEach(function (p) { NF.dots(box, [[xa.map(p[0]), ya.map(p[1])]], color(p[2]), 7, 1); });
    var fit = (DATA.header.fits || [])[0];
    cap.textContent = "Every item of the table: grey, the plotted items in their colours; light bars: the norm ± " +
      "its standard error over the window; dashed: norm = R_eq." +
      (fit ? " " + fit.label.charAt(0).toUpperCase() + fit.label.slice(1) + ": log-log slope " + fit.slope.toFixed(3) + ", Pearson r " + fit.r.toFixed(3) + "." : "");
  }

  // ---------------------------------------------------------------- the items' table
  var LABELS = { observed: "norm", task1: "task1", task2: "task2", decay: "decay", remainder: "remainder",
                 delta_r2: "ΔR²", r_eq_realized: "R_eq realized", r_eq_virtual: "R_eq virtual" };
  var ABOUT = { observed: "window-mean norm R ± standard error (batch means)",
                task1: "first-order task term 2 z·J Δθ_t, window mean per step ± se",
                task2: "second-order task term ‖J Δθ_t‖², window mean per step ± se",
                decay: "weight-decay term, window mean per step ± se",
                remainder: "curvature remainder, window mean per step ± se",
                delta_r2: "realized change of R² per step (the sum of the four), window mean ± se",
                r_eq_realized: "the law solved from the realized window means (the report's prediction)",
                r_eq_virtual: "the law from the virtual probe's window-mean drift, heat and κ" };
  var table = null;
  function columns() {
    var cols = [{ key: "plot", label: "plot", nosort: true, text: true, value: function () { return ""; },
                  html: function (i) {
                    var si = T.series[i];
                    return si < 0 ? "" : '<input type="checkbox" data-series="' + si + '"' +
                      (chosen.indexOf(si) >= 0 ? " checked" : "") + ">";
                  } },
                { key: "id", label: "id", left: true, text: true, value: function (i) { return T.id[i]; },
                  html: function (i) {
                    var si = T.series[i], on = si >= 0 && chosen.indexOf(si) >= 0;
                    return (on ? NF.chipText(color(si), "") : "") + esc(T.id[i]);
                  } }];
    Object.keys(T.q).forEach(function (q) {
      var Q = T.q[q];
      cols.push({ key: q, label: LABELS[q] || q, title: ABOUT[q] || "",
                  value: function (i) { return Q.mean[i]; },
                  html: function (i) { return NF.pmCell(Q.mean[i], Q.se ? Q.se[i] : null); } });
    });
    if (T.dominant) {
      cols.push({ key: "dominant", label: "held up by", left: true, text: true,
                  title: "the larger of the first-order task term (drift) and the heat (task2 + remainder)",
                  value: function (i) { return T.dominant[i]; }, html: function (i) { return esc(T.dominant[i]); } });
    }
    return cols;
  }
  function setupTable() {
    var filter = el("nf-item-filter");
    table = new NF.Table(el("nf-items"), el("nf-item-status"), el("nf-items-more")).configure(columns(), T.n,
      function (i) {
        var f = filter.value.toLowerCase();
        return !f || T.id[i].toLowerCase().indexOf(f) >= 0;
      }, "items");
    filter.addEventListener("input", function () { table.limit = NF.LIMIT; table.refresh(); });
    el("nf-items").addEventListener("change", function (ev) {
      var box = ev.target.closest("input[data-series]");
      if (box) { choose(+box.dataset.series, box.checked); redraw(); }
    });
  }

  // ---------------------------------------------------------------- wiring
  DATA.shown.forEach(function (si) { choose(si, true); });
  setupTable();
  redraw();
  document.body.dataset.ready = "1";
})();
