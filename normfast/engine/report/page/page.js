/* normfast view: the page's script. Plain JavaScript and SVG, no library, no network.
   Reads the run's data from the JSON element #nf-data (written by normfast.engine.report.page). */
(function () {
  "use strict";
  var DATA = JSON.parse(document.getElementById("nf-data").textContent);
  var R = DATA.rows, V = R.v, N = R.n;
  var STATS = {};
  DATA.stats.forEach(function (s) { STATS[s.key] = s; });
  var state = { stat: DATA.stat };
  var LIMIT = NF.LIMIT, fmt = NF.fmt, esc = NF.esc, quantile = NF.quantile, el = NF.el;
  var Table = NF.Table, pmCell = NF.pmCell, svg = NF.svg, axis = NF.axis, frame = NF.frame;
  var dots = NF.dots, chipText = NF.chipText, W = NF.W, H = NF.H, PAD = NF.PAD;

  // ---------------------------------------------------------------- color scales
  // sequential (heat, norms, r_eq): light yellow to dark red; diverging (drift): blue, white, red
  var SEQ = [[255, 255, 204], [255, 237, 160], [254, 217, 118], [254, 178, 76], [253, 141, 60],
             [252, 78, 42], [227, 26, 28], [177, 0, 38]];
  var DIV = [[33, 102, 172], [103, 169, 207], [209, 229, 240], [247, 247, 247], [253, 219, 199],
             [239, 138, 98], [178, 24, 43]];
  function ramp(stops, t) {
    t = Math.max(0, Math.min(1, t));
    var p = t * (stops.length - 1), i = Math.min(stops.length - 2, Math.floor(p)), f = p - i;
    var a = stops[i], b = stops[i + 1];
    return "rgb(" + [0, 1, 2].map(function (k) { return Math.round(a[k] + (b[k] - a[k]) * f); }).join(",") + ")";
  }
  var scales = {};
  function scaleFor(key) {
    if (scales[key]) return scales[key];
    var spec = STATS[key], vals = [], col = V[key];
    for (var i = 0; i < N; i++) {
      if (!R.special[i] && R.valid[i] && col[i] !== null) vals.push(col[i]);
    }
    var s = { key: key, kind: spec.kind, n: vals.length };
    if (spec.kind === "div") {
      var mags = vals.map(Math.abs).sort(function (a, b) { return a - b; });
      var m = quantile(mags, 0.98) || mags[mags.length - 1] || 1;
      s.lo = -m; s.hi = m; s.log = false;
      s.t = function (v) { return (v / m + 1) / 2; };
    } else {
      vals.sort(function (a, b) { return a - b; });
      var lo = quantile(vals, 0.02), hi = quantile(vals, 0.98);
      s.log = vals.length > 0 && vals[0] > 0 && hi / lo > 20;
      var tr = s.log ? Math.log : function (v) { return v; };
      var a = tr(lo), b = tr(hi);
      s.lo = lo; s.hi = hi;
      s.t = function (v) {
        if (s.log && !(v > 0)) return 0;
        return b > a ? (tr(v) - a) / (b - a) : 0.5;
      };
    }
    s.color = function (v) { return ramp(spec.kind === "div" ? DIV : SEQ, s.t(v)); };
    s.dark = function (v) {
      var t = s.t(v);
      return spec.kind === "div" ? Math.abs(t - 0.5) > 0.36 : t > 0.72;
    };
    scales[key] = s;
    return s;
  }
  function tokenStyle(i, key) {
    if (R.special[i]) return { cls: "nf-special", css: "" };
    var v = V[key][i];
    if (!R.valid[i] || v === null) return { cls: "nf-na", css: "" };
    var s = scaleFor(key);
    return { cls: "", css: "background:" + s.color(v) + (s.dark(v) ? ";color:#fff" : "") };
  }

  // ---------------------------------------------------------------- controls and legend
  var statSelect = el("nf-stat");
  DATA.stats.forEach(function (s) {
    var o = document.createElement("option");
    o.value = s.key; o.textContent = s.label; o.title = s.about || "";
    statSelect.appendChild(o);
  });
  statSelect.value = state.stat;
  function drawLegend() {
    var s = scaleFor(state.stat), spec = STATS[state.stat];
    var stops = [];
    for (var k = 0; k <= 10; k++) stops.push(ramp(spec.kind === "div" ? DIV : SEQ, k / 10) + " " + (k * 10) + "%");
    el("nf-legend").innerHTML = '<span>' + esc(fmt(s.lo)) + '</span><span class="nf-bar" style="background:' +
      'linear-gradient(to right,' + stops.join(",") + ')"></span><span>' + esc(fmt(s.hi)) + '</span><span>' +
      (spec.kind === "div" ? "diverging around 0" : (s.log ? "log scale" : "linear scale")) +
      ", 2nd to 98th percentile of the shown rows; special tokens left out</span>";
    Array.prototype.forEach.call(document.querySelectorAll(".nf-stat-name"), function (e) {
      e.textContent = spec.label;
    });
  }

  // ---------------------------------------------------------------- tooltip
  var tip = el("nf-tip");
  function pm(key, i) {
    var v = V[key] ? V[key][i] : null, spec = STATS[key] || {};
    var txt = fmt(v);
    if (spec.se && V[spec.se] && V[spec.se][i] !== null) txt += " ± " + fmt(V[spec.se][i]);
    if (spec.lo && V[spec.lo] && V[spec.lo][i] !== null && V[spec.hi][i] !== null) {
      txt += " [" + fmt(V[spec.lo][i]) + ", " + fmt(V[spec.hi][i]) + "]";
    }
    return '<td data-q="' + esc(key) + '" data-value="' + (v === null ? "" : v) + '">' + esc(txt) + "</td>";
  }
  function tipHtml(i) {
    var d = DATA.docs[R.doc[i]];
    var head = R.tok.length ? "<b>" + esc(R.tok[i] || "∅") + "</b> " : "";
    var h = head + '<span style="color:#aab">' + esc(d ? d.label : "") + " · position " + R.pos[i] + "</span>";
    if (R.special[i]) h += "<div>special token: left out of the scale and the aggregates</div>";
    if (!R.valid[i]) h += "<div>no valid statistics for this row</div>";
    var rows = [[DATA.heat, "heat " + DATA.heat], [DATA.drift, "drift " + DATA.drift], ["norm", "norm"],
                ["r_eq", "r_eq [95%]"], ["r_eq_heat", "r_eq_heat"], ["kappa", "κ"]];
    h += "<table>";
    rows.forEach(function (r) { if (V[r[0]]) h += "<tr><td>" + esc(r[1]) + "</td>" + pm(r[0], i) + "</tr>"; });
    var reg = R.regime[i] >= 0 ? DATA.regimes[R.regime[i]] : "n/a";
    if (R.reasons && R.reason[i] >= 0) reg += " (" + R.reasons[R.reason[i]].replace(/_/g, " ") + ")";
    h += '<tr><td>regime</td><td data-q="regime">' + esc(reg) + "</td></tr></table>";
    return h;
  }
  function showTip(i, ev) {
    tip.innerHTML = tipHtml(i);
    tip.hidden = false;
    var x = ev.clientX + 14, y = ev.clientY + 14, w = tip.offsetWidth, hgt = tip.offsetHeight;
    if (x + w > window.innerWidth - 4) x = Math.max(4, ev.clientX - w - 10);
    if (y + hgt > window.innerHeight - 4) y = Math.max(4, ev.clientY - hgt - 10);
    tip.style.left = x + "px"; tip.style.top = y + "px";
  }
  function hideTip() { tip.hidden = true; }

  // ---------------------------------------------------------------- text view
  var textBox = el("nf-text"), docSelect = el("nf-doc");
  function docRows(d) {
    if (d.view) return d.view;
    var out = [];
    for (var i = d.start; i < d.end; i++) out.push(i);
    return out;
  }
  function drawText() {
    if (!textBox) return;
    var which = docSelect.value, docs = which === "all" ? DATA.docs : [DATA.docs[+which]];
    // short inputs (a word list) flow as one paragraph, their special tokens left out of the view
    var flow = docs.length > 1 && compact;
    var parts = flow ? ['<p class="nf-doc nf-flow">'] : [];
    docs.forEach(function (d) {
      if (!flow) parts.push('<p class="nf-doc">');
      if (docs.length > 1 && !flow) parts.push('<span class="nf-doc-label">' + esc(d.label) + "</span>");
      if (flow) parts.push('<span class="nf-item" title="' + esc(d.label) + '">');
      var k = 0;
      docRows(d).forEach(function (i) {
        if (flow && R.special[i]) return;
        var st = tokenStyle(i, state.stat);
        if (R.gap[i] && k > 0) parts.push(" ");
        k++;
        parts.push('<span class="nf-tok ' + st.cls + '" data-r="' + i + '" data-item="' + R.item[i] +
                   '" data-pos="' + R.pos[i] + '" style="' + st.css + '">' + esc(R.tok[i]) + "</span>");
      });
      parts.push(flow ? "</span> " : "</p>");
    });
    if (flow) parts.push("</p>");
    textBox.innerHTML = parts.join("");
  }
  var compact = false;
  if (textBox) {
    var shownRows = 0;
    DATA.docs.forEach(function (d) { shownRows += docRows(d).length; });
    compact = shownRows <= 6 * DATA.docs.length;
    // every document at once: a word list flows in one paragraph; long documents only while few
    if (DATA.docs.length > 1 && (compact || shownRows <= 6000)) {
      var all = document.createElement("option");
      all.value = "all"; all.textContent = "all " + DATA.docs.length + " " + DATA.sample.unit;
      docSelect.appendChild(all);
    }
    DATA.docs.forEach(function (d, k) {
      var o = document.createElement("option");
      o.value = String(k); o.textContent = d.label;
      docSelect.appendChild(o);
    });
    docSelect.addEventListener("change", drawText);
    textBox.addEventListener("mouseover", function (ev) {
      var t = ev.target.closest(".nf-tok");
      if (t) showTip(+t.dataset.r, ev);
    });
    textBox.addEventListener("mousemove", function (ev) {
      var t = ev.target.closest(".nf-tok");
      if (t) showTip(+t.dataset.r, ev); else hideTip();
    });
    textBox.addEventListener("mouseleave", hideTip);
  }

  // ---------------------------------------------------------------- tables
  var typeTable = null, typeBy = null;
  function typeColumns(T) {
    var cols = [{ key: "label", label: typeBy === "word" ? "word" : "token", left: true, text: true,
                  value: function (i) { return T.label[i]; },
                  html: function (i) { return esc(T.label[i]); } },
                { key: "count", label: "count", title: "valid occurrences (the means are over these)",
                  value: function (i) { return T.count[i]; }, html: function (i) { return T.count[i].toLocaleString(); } }];
    (DATA.type_quantities || DATA.quantities).forEach(function (q) {
      var Q = T.q[q];
      cols.push({ key: q, label: q === "heat_rel" ? "relative heat" : (STATS[q] || { label: q }).label.replace(/ \(.*\)$/, ""),
                  title: q === "heat_rel" ? "mean of log " + DATA.heat + " minus the run's median, ± its standard error: the ranking" :
                    "mean ± standard error over the type's occurrences",
                  value: function (i) { return Q.mean[i]; }, html: function (i) { return pmCell(Q.mean[i], Q.se[i]); } });
    });
    if (T.zipf) {
      cols.push({ key: "zipf", label: "Zipf", title: "English word frequency (wordfreq; log10 per billion words)",
                  value: function (i) { return T.zipf[i]; }, html: function (i) { return esc(fmt(T.zipf[i])); } });
    }
    return cols;
  }
  function setupTypes() {
    var tabs = el("nf-type-tabs");
    if (!tabs) return;
    var kinds = Object.keys(DATA.types);
    if (!kinds.length) { el("nf-types-section").hidden = true; return; }
    var filterBox = el("nf-type-filter"), minBox = el("nf-type-min"), punctBox = el("nf-type-punct");
    function note(T) {
      var m = +minBox.value || 0, left = 0, punct = 0;
      for (var i = 0; i < T.n; i++) {
        if (T.count[i] < m) left++;
        else if (T.punct[i] && !punctBox.checked) punct++;
      }
      el("nf-type-rank").textContent = "Ranked by " + (T.rank.key === "heat_rel" ? "the mean relative heat (log " +
        DATA.heat + " minus the run's median)" : "the mean " + T.rank.key) + ", hottest first, over the types seen at least " +
        m + " time" + (m === 1 ? "" : "s") + ", as the summary and normfast aggregate rank them: " + left +
        " type" + (left === 1 ? "" : "s") + " seen fewer times" +
        (punctBox.checked ? "" : " and " + punct + " punctuation type" + (punct === 1 ? "" : "s")) + " are hidden.";
    }
    function select(by) {
      typeBy = by;
      var T = DATA.types[by];
      minBox.value = Math.max(+minBox.value || 0, T.rank.min, T.min_count);
      Array.prototype.forEach.call(tabs.children, function (b) { b.classList.toggle("nf-on", b.dataset.by === by); });
      if (typeTable.sort === null) { typeTable.sort = T.rank.key; typeTable.desc = true; }
      typeTable.configure(typeColumns(T), T.n, function (i) {
        var f = filterBox.value.toLowerCase(), m = +minBox.value || 0;
        return T.count[i] >= m && (punctBox.checked || !T.punct[i]) && (!f || T.label[i].toLowerCase().indexOf(f) >= 0);
      }, "types" + (T.total > T.n ? "; the " + T.n.toLocaleString() + " most frequent of " +
                    T.total.toLocaleString() + " are on this page" : "")).refresh();
      note(T);
    }
    typeTable = new Table(el("nf-types"), el("nf-type-status"), el("nf-types-more"));
    kinds.forEach(function (by) {
      var b = document.createElement("button");
      b.type = "button"; b.dataset.by = by;
      b.textContent = "by " + by + " (" + DATA.types[by].total.toLocaleString() + ")";
      b.addEventListener("click", function () { select(by); });
      tabs.appendChild(b);
    });
    filterBox.addEventListener("input", function () { typeTable.limit = LIMIT; typeTable.refresh(); });
    minBox.addEventListener("input", function () { typeTable.limit = LIMIT; typeTable.refresh(); note(DATA.types[typeBy]); });
    punctBox.addEventListener("change", function () { typeTable.limit = LIMIT; typeTable.refresh(); note(DATA.types[typeBy]); });
    select(kinds[0]);
  }

  // rows
  var rowTable = null;
  function rowColumns() {
    var cols = [];
    var chip = function (i) {
      var st = tokenStyle(i, state.stat);
      var bg = st.css ? st.css.split(";")[0] : (R.special[i] ? "background:#eceef0" : "background:#ddd");
      return '<span class="nf-chip" style="' + bg + '"></span>';
    };
    if (DATA.kind === "pooled") {
      cols.push({ key: "id", label: "id", left: true, text: true, value: function (i) { return R.id[i]; },
                  html: function (i) { return chip(i) + esc(R.id[i]); } });
      cols.push({ key: "text", label: "text", left: true, text: true, cls: "nf-text-cell",
                  value: function (i) { return R.text[i]; }, html: function (i) { return esc(R.text[i]); } });
    } else {
      cols.push({ key: "tok", label: "token", left: true, text: true, value: function (i) { return R.tok[i]; },
                  html: function (i) { return chip(i) + esc(R.tok[i]); } });
      cols.push({ key: "doc", label: DATA.kind === "corpus" ? "document" : "input", left: true, text: true,
                  cls: "nf-text-cell", value: function (i) { return DATA.docs[R.doc[i]].label; },
                  html: function (i) { return esc(DATA.docs[R.doc[i]].label.slice(0, 40)); } });
      cols.push({ key: "pos", label: "pos", value: function (i) { return R.pos[i]; },
                  html: function (i) { return String(R.pos[i]); } });
    }
    DATA.stats.forEach(function (s) {
      var key = s.key;
      cols.push({ key: key, label: s.label.replace(/ \(.*\)$/, ""), title: s.about,
                  value: function (i) { return V[key][i]; },
                  html: function (i) {
                    var h = pmCell(V[key][i], s.se ? V[s.se][i] : null);
                    if (s.lo && V[s.lo][i] !== null && V[s.hi][i] !== null) {
                      h += ' <span class="nf-pm">[' + esc(fmt(V[s.lo][i])) + ", " + esc(fmt(V[s.hi][i])) + "]</span>";
                    }
                    return h;
                  } });
    });
    cols.push({ key: "regime", label: "regime", left: true, text: true,
                value: function (i) { return R.regime[i] >= 0 ? DATA.regimes[R.regime[i]] : ""; },
                html: function (i) { return esc(R.regime[i] >= 0 ? DATA.regimes[R.regime[i]] : "n/a"); } });
    return cols;
  }
  function setupRows() {
    var filterBox = el("nf-row-filter"), special = el("nf-row-special");
    rowTable = new Table(el("nf-rows"), el("nf-row-status"), el("nf-rows-more")).configure(rowColumns(), N, function (i) {
      if (special && !special.checked && R.special[i]) return false;
      var f = filterBox.value.toLowerCase();
      if (!f) return true;
      var hay = DATA.kind === "pooled" ? R.id[i] + " " + R.text[i] : R.tok[i] + " " + DATA.docs[R.doc[i]].label;
      return hay.toLowerCase().indexOf(f) >= 0;
    }, "rows");
    filterBox.addEventListener("input", function () { rowTable.limit = LIMIT; rowTable.refresh(); });
    if (special) special.addEventListener("change", function () { rowTable.refresh(); });
    rowTable.refresh();
  }

  // ---------------------------------------------------------------- figures (SVG)
  function drawLaw() {
    var box = el("nf-fig-law"), applies = [], other = [], xs = [], ys = [];
    var heatDom = [];
    for (var i = 0; i < N; i++) {
      var x = V.r_eq[i], y = V.norm[i];
      if (R.special[i] || !R.valid[i] || !(x > 0) || !(y > 0)) continue;
      xs.push(x); ys.push(y);
      (R.regime[i] === 0 ? applies : R.regime[i] === 1 ? heatDom : other).push([x, y]);
    }
    var cap = el("nf-cap-law");
    if (!xs.length) {
      frame(box, "Observed norm vs predicted r_eq", "r_eq", "norm", axis(1, 10, true, PAD.l, W - PAD.r),
            axis(1, 10, true, H - PAD.b, PAD.t));
      cap.textContent = "No row has both a positive norm and an r_eq.";
      return;
    }
    var lo = Math.min.apply(null, xs.concat(ys)), hi = Math.max.apply(null, xs.concat(ys));
    var xa = axis(Math.min.apply(null, xs), Math.max.apply(null, xs), true, PAD.l, W - PAD.r);
    var ya = axis(Math.min.apply(null, ys), Math.max.apply(null, ys), true, H - PAD.b, PAD.t);
    var n = applies.length + heatDom.length;
    frame(box, "Observed norm vs r_eq: the law applies to " + n + " of " + xs.length + " rows",
          "predicted r_eq (log)", "observed norm (log)", xa, ya);
    // the identity, where norms would sit if the model were at its equilibrium
    var a = Math.max(lo, Math.pow(10, Math.max(xa.lo, ya.lo))), b = Math.min(hi, Math.pow(10, Math.min(xa.hi, ya.hi)));
    var identity = b > a;
    if (identity) svg(box, "path", { d: "M" + xa.map(a) + " " + ya.map(a) + "L" + xa.map(b) + " " + ya.map(b),
                                     stroke: "#999", "stroke-dasharray": "4 3", fill: "none" });
    var mp = function (p) { return [xa.map(p[0]), ya.map(p[1])]; };
    dots(box, other.map(mp), "#b5bbc1", 3.2, 0.7);
    dots(box, heatDom.map(mp), "#e08214", 3.6, 0.8);
    dots(box, applies.map(mp), "#b2182b", 3.6, 0.8);
    cap.innerHTML = chipText("#b2182b", "law applicable (" + applies.length + ")") + " &nbsp; " +
      chipText("#e08214", "heat-dominated (" + heatDom.length + ")") + " &nbsp; " +
      chipText("#b5bbc1", "no prediction (law not applicable, or objective saturated), greyed (" + other.length + ")") +
      (identity ? " &nbsp; dashed: norm = r_eq. " : " &nbsp; (norm = r_eq lies outside these axes: r_eq and the norms do not overlap.) ") +
      (DATA.sample.all ? "All rows" : "The sampled rows") +
      " with valid statistics, special tokens left out.";
  }

  function drawHeat() {
    var box = el("nf-fig-heat"), H0 = DATA.hist, cap = el("nf-cap-heat");
    if (!H0.counts.length) {
      frame(box, "Heat " + DATA.heat + ": no positive values", "", "", axis(0, 1, false, PAD.l, W - PAD.r),
            axis(0, 1, false, H - PAD.b, PAD.t));
      cap.textContent = "";
      return;
    }
    var merge = Math.max(1, Math.ceil(H0.counts.length / 70)), bars = [];
    for (var k = 0; k < H0.counts.length; k += merge) {
      var c = 0;
      for (var j = k; j < Math.min(k + merge, H0.counts.length); j++) c += H0.counts[j];
      bars.push([H0.lo + k * H0.step, H0.lo + Math.min(k + merge, H0.counts.length) * H0.step, c]);
    }
    var top = Math.max.apply(null, bars.map(function (b) { return b[2]; }));
    var xa = axis(Math.pow(10, bars[0][0]), Math.pow(10, bars[bars.length - 1][1]), true, PAD.l, W - PAD.r);
    var ya = axis(0, top, false, H - PAD.b, PAD.t);
    frame(box, "Heat " + DATA.heat + " over all " + H0.total.toLocaleString() + " valid rows",
          DATA.heat + " (log)", "rows", xa, ya);
    var y0 = ya.map(0);
    bars.forEach(function (b) {
      var x0 = xa.map(Math.pow(10, b[0])), x1 = xa.map(Math.pow(10, b[1])), y = ya.map(b[2]);
      svg(box, "rect", { x: x0, y: y, width: Math.max(0.5, x1 - x0 - 0.5), height: Math.max(0, y0 - y), fill: "#d6604d" });
    });
    cap.textContent = "Histogram in log10 bins of " + (H0.step * merge).toFixed(2) + ", every valid row but the special tokens" +
      (H0.nonpositive ? "; " + H0.nonpositive + " rows with " + DATA.heat + " ≤ 0 not drawn" : "") + ".";
  }

  var freqMode = null;
  function drawFreq() {
    var fig = el("nf-freq-figure"), box = el("nf-fig-freq"), cap = el("nf-cap-freq"), choice = el("nf-freq-choice");
    var by = DATA.types.word ? "word" : (DATA.types.token ? "token" : null);
    var T = by ? DATA.types[by] : null;
    var modes = [];
    if (T) {
      if (Math.max.apply(null, T.count.concat([0])) >= 2) modes.push("count");
      if (T.zipf) modes.push("zipf");
      // a word list (most types seen once): word frequency first; a corpus: how often types occur in it
      var sorted = T.count.slice().sort(function (a, b) { return a - b; });
      if (modes.length > 1 && quantile(sorted, 0.5) < 2) modes.reverse();
    }
    if (!modes.length) { fig.hidden = true; return; }
    if (!freqMode || modes.indexOf(freqMode) < 0) freqMode = modes[0];
    if (modes.length > 1 && !choice.childNodes.length) {
      modes.forEach(function (m) {
        var lab = document.createElement("label"), r = document.createElement("input");
        r.type = "radio"; r.name = "nf-freq"; r.value = m; r.checked = m === freqMode;
        r.addEventListener("change", function () { freqMode = m; drawFreq(); });
        lab.appendChild(r);
        lab.appendChild(document.createTextNode(m === "count" ? " occurrences in this run  " : " English Zipf frequency (wordfreq)"));
        choice.appendChild(lab);
      });
    }
    var Q = T.q[DATA.heat], pts = [];
    var limit = Math.min(T.n, 4000);
    for (var i = 0; i < limit; i++) {
      var y = Q.mean[i], x = freqMode === "count" ? T.count[i] : T.zipf[i];
      if (!(y > 0) || x === null || !(freqMode === "zipf" || x >= 1)) continue;
      pts.push([x, y, Q.se[i]]);
    }
    if (!pts.length) { fig.hidden = true; return; }
    var xs = pts.map(function (p) { return p[0]; }), ys = pts.map(function (p) { return p[1]; });
    var xa = axis(Math.min.apply(null, xs), Math.max.apply(null, xs), freqMode === "count", PAD.l, W - PAD.r);
    var ya = axis(Math.min.apply(null, ys), Math.max.apply(null, ys), true, H - PAD.b, PAD.t);
    frame(box, "Type heat vs " + (freqMode === "count" ? "how often the type occurs" : "word frequency") +
          " (" + pts.length + " " + by + "s)", freqMode === "count" ? "occurrences in this run (log)" :
          "Zipf frequency (wordfreq, English)", "mean " + DATA.heat + " per " + by + " (log)", xa, ya);
    var bars = [];
    pts.forEach(function (p) {
      if (!(p[2] > 0)) return;
      var x = xa.map(p[0]), lo = Math.max(p[1] - p[2], p[1] * 1e-3);
      bars.push("M" + x.toFixed(1) + " " + ya.map(lo).toFixed(1) + "V" + ya.map(p[1] + p[2]).toFixed(1));
    });
    if (bars.length) svg(box, "path", { d: bars.join(""), stroke: "#92c5de", "stroke-width": 1, fill: "none", "stroke-opacity": 0.6 });
    dots(box, pts.map(function (p) { return [xa.map(p[0]), ya.map(p[1])]; }), "#2166ac", 3.4, 0.8);
    cap.textContent = "One point per " + by + " (mean over its valid occurrences), light bars ± one standard error " +
      "(types seen at least twice: " + bars.length + ")" +
      (T.n > limit ? "; the " + limit + " most frequent types" : "") + ".";
  }

  // ---------------------------------------------------------------- wiring
  function recolor() {
    drawLegend();
    drawText();
    if (rowTable) { rowTable.columns = rowColumns(); rowTable.refresh(); }
  }
  statSelect.addEventListener("change", function () { state.stat = statSelect.value; recolor(); });
  drawLegend();
  drawText();
  setupTypes();
  setupRows();
  drawLaw();
  drawHeat();
  drawFreq();
  document.body.dataset.ready = "1";
})();
