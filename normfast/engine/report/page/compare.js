/* normfast compare: the page's script, after the family's helpers (common.js, the global NF).
   Reads the comparison from the JSON element #nf-data (written by normfast.engine.report.page.compare). */
(function () {
  "use strict";
  var DATA = JSON.parse(document.getElementById("nf-data").textContent);
  var fmt = NF.fmt, esc = NF.esc, el = NF.el, axis = NF.axis;
  var T = DATA.types, QS = DATA.quantities, FLAG = "#b2182b", PLAIN = "#7a8591";

  // ---------------------------------------------------------------- one figure per quantity
  function drawQuantity(q) {
    var box = el("nf-fig-" + q), cap = el("nf-cap-" + q), Q = T.q[q], pts = [];
    for (var i = 0; i < T.n; i++) {
      if (Q.a[i] === null || Q.b[i] === null) continue;
      pts.push({ x: Q.a[i], y: Q.b[i], sx: Q.se_a[i], sy: Q.se_b[i], on: Q.changed[i] === 1 });
    }
    var xr = NF.xRange(box), yr = NF.yRange(box);
    if (!pts.length) {
      NF.frame(box, q + ": no type has a value in both runs", "run A", "run B", axis(0, 1, false, xr[0], xr[1]),
               axis(0, 1, false, yr[0], yr[1]));
      cap.textContent = "";
      return;
    }
    // each axis spans its own run's values (a run whose values all moved far would squeeze the other
    // run's spread into a line on shared axes); the dashed diagonal is B = A where the two overlap
    var ex = NF.extent(pts.map(function (p) { return p.x; })), ey = NF.extent(pts.map(function (p) { return p.y; }));
    var log = ex[0] > 0 && ey[0] > 0 && Math.max(ex[1], ey[1]) / Math.min(ex[0], ey[0]) > 20;
    var xa = axis(ex[0], ex[1], log, xr[0], xr[1]), ya = axis(ey[0], ey[1], log, yr[0], yr[1]);
    var unlog = function (v) { return log ? Math.pow(10, v) : v; };
    var d0 = Math.max(unlog(xa.lo), unlog(ya.lo)), d1 = Math.min(unlog(xa.hi), unlog(ya.hi));
    var flagged = pts.filter(function (p) { return p.on; }).length;
    NF.frame(box, q + ": " + flagged + " of " + pts.length + " " + DATA.unit + " changed", q + " in run A" +
             (log ? " (log)" : ""), q + " in run B" + (log ? " (log)" : ""), xa, ya);
    if (d1 > d0) NF.line(box, [[xa.map(d0), ya.map(d0)], [xa.map(d1), ya.map(d1)]], "#999", 1, "4 3");
    // error bars first, light, so that the points sit on top of them; clipped to the axes
    var inside = NF.area(box), lo = unlog(Math.min(xa.lo, ya.lo));
    var clip = function (v) { return log ? Math.max(v, lo) : v; };
    [false, true].forEach(function (on) {
      var color = on ? FLAG : PLAIN, vs = [], hs = [];
      pts.forEach(function (p) {
        if (p.on !== on) return;
        if (p.sy > 0) vs.push([xa.map(p.x), ya.map(clip(p.y - p.sy)), ya.map(p.y + p.sy)]);
        if (p.sx > 0) hs.push([ya.map(p.y), xa.map(clip(p.x - p.sx)), xa.map(p.x + p.sx)]);
      });
      NF.bars(inside, vs, color, 0.25);
      if (hs.length) {
        NF.svg(inside, "path", { d: hs.map(function (s) { return "M" + s[1].toFixed(1) + " " + s[0].toFixed(1) + "H" + s[2].toFixed(1); }).join(""),
                              stroke: color, "stroke-width": 1, "stroke-opacity": 0.25, fill: "none" });
      }
    });
    NF.dots(box, pts.filter(function (p) { return !p.on; }).map(function (p) { return [xa.map(p.x), ya.map(p.y)]; }), PLAIN, 3.6, 0.75);
    NF.dots(box, pts.filter(function (p) { return p.on; }).map(function (p) { return [xa.map(p.x), ya.map(p.y)]; }), FLAG, 4.4, 0.9);
    cap.innerHTML = NF.chipText(FLAG, "changed (" + flagged + ")") + " &nbsp; " + NF.chipText(PLAIN, "not flagged (" +
      (pts.length - flagged) + ")") + ". " + esc(DATA.about[q]) + ".";
  }

  // ---------------------------------------------------------------- the types' table
  var table = null;
  function diffCell(Q, i) {
    var title = "A " + fmt(Q.a[i]) + " ± " + fmt(Q.se_a[i]) + ", B " + fmt(Q.b[i]) + " ± " + fmt(Q.se_b[i]) +
      ", p " + fmt(Q.p[i]);
    return '<span title="' + esc(title) + '"' + (Q.changed[i] ? ' class="nf-flag"' : "") + ">" + NF.pmCell(Q.diff[i], Q.se[i]) +
      "</span>";
  }
  function columns() {
    var cols = [{ key: "label", label: DATA.by === "item" ? "input" : "token", left: true, text: true,
                  value: function (i) { return T.label[i]; }, html: function (i) { return esc(T.label[i]); } },
                { key: "occurrences", label: "occurrences", title: "the type's rows (token rows; special tokens left out)",
                  value: function (i) { return T.occurrences[i]; },
                  html: function (i) { return T.occurrences[i].toLocaleString(); } }];
    QS.forEach(function (q) {
      var Q = T.q[q];
      cols.push({ key: q + "_diff", label: "Δ " + q, title: "B − A ± standard error (" + DATA.about[q] + ")",
                  value: function (i) { return Q.diff[i]; }, html: function (i) { return diffCell(Q, i); } });
      cols.push({ key: q + "_z", label: "z", title: "(B − A) / se for " + q,
                  value: function (i) { return Q.z[i]; }, html: function (i) { return esc(fmt(Q.z[i])); } });
    });
    cols.push({ key: "changed", label: "changed", left: true, text: true,
                title: "the quantities whose change the test flags (Benjamini-Hochberg, q = " + DATA.q + ")",
                value: function (i) { return changed(i); },
                html: function (i) { return '<span class="nf-flag">' + esc(changed(i)) + "</span>"; } });
    return cols;
  }
  function changed(i) {
    return QS.filter(function (q) { return T.q[q].changed[i] === 1; }).join(", ");
  }
  function setupTable() {
    var filter = el("nf-type-filter"), only = el("nf-changed-only");
    table = new NF.Table(el("nf-types"), el("nf-type-status"), el("nf-types-more")).configure(columns(), T.n,
      function (i) {
        var f = filter.value.toLowerCase();
        if (only.checked && !changed(i)) return false;
        return !f || T.label[i].toLowerCase().indexOf(f) >= 0;
      }, DATA.unit + (T.total > T.n ? "; the " + T.n.toLocaleString() + " most significant of " +
                     T.total.toLocaleString() + " are on this page" : ""));
    filter.addEventListener("input", function () { table.limit = NF.LIMIT; table.refresh(); });
    only.addEventListener("change", function () { table.limit = NF.LIMIT; table.refresh(); });
    table.refresh();
  }

  QS.forEach(drawQuantity);
  setupTable();
  document.body.dataset.ready = "1";
})();
