/* normfast pages: what every page of the family shares (numbers in words, sortable tables, SVG
   figures). Plain JavaScript, no library, no network. Defines one global, NF; each page's own
   script follows it in the same <script> element. */
var NF = (function () {
  "use strict";
  var LIMIT = 200;

  // ---------------------------------------------------------------- formatting
  function fmt(x) {
    if (x === null || x === undefined || !isFinite(x)) return "n/a";
    var a = Math.abs(x);
    if (a !== 0 && (a < 1e-3 || a >= 1e5)) return x.toExponential(3).replace("e+", "e");
    return String(Number(x.toPrecision(4)));
  }
  function fmtAxis(x) {
    var a = Math.abs(x);
    if (a >= 1e9) return String(Number((x / 1e9).toPrecision(3))) + "G";
    if (a >= 1e6) return String(Number((x / 1e6).toPrecision(3))) + "M";
    if (a >= 1e4) return String(Number((x / 1e3).toPrecision(3))) + "k";
    return fmt(x);
  }
  function esc(s) {
    return String(s).replace(/[&<>"']/g, function (c) {
      return { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c];
    });
  }
  function num(x) { return x === null || x === undefined || !isFinite(x) ? NaN : x; }
  function quantile(sorted, q) {
    if (!sorted.length) return NaN;
    var p = (sorted.length - 1) * q, i = Math.floor(p), f = p - i;
    return i + 1 < sorted.length ? sorted[i] * (1 - f) + sorted[i + 1] * f : sorted[i];
  }
  function el(id) { return document.getElementById(id); }
  function pmCell(mean, se) {
    return esc(fmt(mean)) + (se !== null && se !== undefined && isFinite(se) ?
      ' <span class="nf-pm">± ' + esc(fmt(se)) + "</span>" : "");
  }

  // ---------------------------------------------------------------- a sortable, filterable table
  // columns: {key, label, title, left, text, cls, value(i), html(i)}; numbers sort with n/a last
  function Table(table, status, more) {
    this.table = table; this.status = status; this.more = more; this.limit = LIMIT; this.sort = null; this.desc = true;
    var self = this;
    table.addEventListener("click", function (ev) {
      var th = ev.target.closest("th");
      if (!th || th.dataset.nosort) return;
      var key = th.dataset.key;
      if (self.sort === key) self.desc = !self.desc;
      else { self.sort = key; self.desc = !self.colByKey(key).text; }
      self.limit = LIMIT;
      self.refresh();
    });
    more.addEventListener("click", function () { self.limit += LIMIT * 5; self.refresh(); });
  }
  Table.prototype.configure = function (columns, n, filter, noun) {
    this.columns = columns; this.n = n; this.filter = filter; this.noun = noun; this.limit = LIMIT;
    if (this.sort !== null && !this.colByKey(this.sort)) this.sort = null;
    return this;
  };
  Table.prototype.colByKey = function (key) {
    return this.columns.filter(function (c) { return c.key === key; })[0];
  };
  Table.prototype.refresh = function () {
    var idx = [], i, self = this;
    for (i = 0; i < this.n; i++) if (this.filter(i)) idx.push(i);
    if (this.sort !== null) {
      var col = this.colByKey(this.sort), sign = this.desc ? -1 : 1;
      if (col.text) {
        idx.sort(function (a, b) { return sign * String(col.value(a)).localeCompare(String(col.value(b))); });
      } else {
        idx.sort(function (a, b) {
          var x = num(col.value(a)), y = num(col.value(b));
          if (isNaN(x)) return isNaN(y) ? a - b : 1;
          if (isNaN(y)) return -1;
          return x === y ? a - b : sign * (x - y);
        });
      }
    }
    var head = "<thead><tr>" + this.columns.map(function (c) {
      var on = c.key === self.sort;
      return '<th data-key="' + esc(c.key) + '" class="' + (c.left ? "nf-left " : "") + (on ? "nf-sorted" : "") +
        '"' + (c.nosort ? ' data-nosort="1"' : "") + ' title="' + esc(c.title || "") + '">' + esc(c.label) +
        (on ? (self.desc ? " ▼" : " ▲") : "") + "</th>";
    }).join("") + "</tr></thead>";
    var body = [], shown = Math.min(idx.length, this.limit);
    for (var k = 0; k < shown; k++) {
      var r = idx[k];
      body.push('<tr data-i="' + r + '">' + this.columns.map(function (c) {
        var v = c.text ? null : c.value(r);
        return '<td class="' + (c.left ? "nf-left " : "") + (c.cls || "") + '"' +
          (c.text ? "" : ' data-key="' + esc(c.key) + '" data-value="' + (v === null || v === undefined ? "" : v) + '"') +
          ">" + c.html(r) + "</td>";
      }).join("") + "</tr>");
    }
    this.table.innerHTML = head + "<tbody>" + body.join("") + "</tbody>";
    this.status.textContent = "showing " + shown.toLocaleString() + " of " + idx.length.toLocaleString() +
      " " + this.noun + (idx.length < this.n ? " (of " + this.n.toLocaleString() + ")" : "");
    this.more.hidden = shown >= idx.length;
  };

  // ---------------------------------------------------------------- figures (SVG)
  // A figure's size is its <svg>'s viewBox; W, H are the standard figure's
  var NS = "http://www.w3.org/2000/svg", W = 460, H = 340, PAD = { l: 62, r: 14, t: 30, b: 44 };
  function svg(parent, tag, attrs, text) {
    var e = document.createElementNS(NS, tag);
    for (var k in attrs) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    parent.appendChild(e);
    return e;
  }
  function size(box) {
    var vb = box.viewBox && box.viewBox.baseVal;
    return { W: vb && vb.width ? vb.width : W, H: vb && vb.height ? vb.height : H };
  }
  function niceStep(span, n) {
    var raw = span / n, p = Math.pow(10, Math.floor(Math.log10(raw))), f = raw / p;
    return (f < 1.5 ? 1 : f < 3.5 ? 2 : f < 7.5 ? 5 : 10) * p;
  }
  // an axis over [lo, hi] drawn from pixel a to pixel b (log10 when log), with its ticks
  function axis(lo, hi, log, a, b) {
    if (log) { lo = Math.log10(lo); hi = Math.log10(hi); }
    if (!(hi > lo)) { lo -= 0.5; hi += 0.5; }
    var pad = (hi - lo) * 0.04; lo -= pad; hi += pad;
    var ax = { log: log, lo: lo, hi: hi };
    ax.map = function (v) { var x = log ? Math.log10(v) : v; return a + (x - lo) / (hi - lo) * (b - a); };
    var ticks = [];
    if (log) {
      // 1-2-5 (or finer) within a decade or two, powers of ten over many decades
      var span = hi - lo, mult = span < 1.2 ? [1, 2, 3, 5, 7] : span < 3 ? [1, 2, 5] : [1];
      var step = mult.length > 1 ? 1 : Math.max(1, Math.ceil(span / 6));
      for (var e = Math.floor(lo); e <= Math.ceil(hi); e += step) {
        mult.forEach(function (m) {
          var v = m * Math.pow(10, e), lv = Math.log10(v);
          if (lv >= lo && lv <= hi) ticks.push([v, e >= -3 && e <= 4 ? fmtAxis(Number(v.toPrecision(3))) : m + "e" + e]);
        });
      }
      if (ticks.length < 2) {
        var a0 = Math.pow(10, lo), a1 = Math.pow(10, hi), s = niceStep(a1 - a0, 4);
        ticks = [];
        for (var t = Math.ceil(a0 / s) * s; t <= a1; t += s) if (t > 0) ticks.push([t, fmtAxis(Number(t.toPrecision(6)))]);
      }
    } else {
      var st = niceStep(hi - lo, 5);
      for (var u = Math.ceil(lo / st) * st; u <= hi + 1e-12; u += st) ticks.push([u, fmtAxis(Math.abs(u) < st / 1e6 ? 0 : u)]);
    }
    ax.ticks = ticks;
    return ax;
  }
  // the pixel ranges of a figure's axes: x from left to right, y from bottom to top
  function xRange(box) { return [PAD.l, size(box).W - PAD.r]; }
  function yRange(box) { return [size(box).H - PAD.b, PAD.t]; }
  function frame(box, title, xlab, ylab, xa, ya) {
    var s = size(box), w = s.W, h = s.H;
    while (box.firstChild) box.removeChild(box.firstChild);
    svg(box, "text", { x: w / 2, y: 16, "text-anchor": "middle", "class": "nf-title" }, title);
    var g = svg(box, "g", { "class": "nf-axis" });
    xa.ticks.forEach(function (t) {
      var x = xa.map(t[0]);
      svg(g, "line", { x1: x, x2: x, y1: PAD.t, y2: h - PAD.b, "class": "nf-grid" });
      svg(g, "text", { x: x, y: h - PAD.b + 14, "text-anchor": "middle" }, t[1]);
    });
    ya.ticks.forEach(function (t) {
      var y = ya.map(t[0]);
      svg(g, "line", { x1: PAD.l, x2: w - PAD.r, y1: y, y2: y, "class": "nf-grid" });
      svg(g, "text", { x: PAD.l - 5, y: y + 4, "text-anchor": "end" }, t[1]);
    });
    svg(g, "path", { d: "M" + PAD.l + " " + PAD.t + "V" + (h - PAD.b) + "H" + (w - PAD.r), fill: "none" });
    // the plot area, for what may reach past the axes' ends (error bars): see area()
    if (box.id) {
      var clip = svg(svg(box, "defs", {}), "clipPath", { id: box.id + "-area" });
      svg(clip, "rect", { x: PAD.l, y: PAD.t, width: w - PAD.l - PAD.r, height: h - PAD.t - PAD.b });
    }
    svg(box, "text", { x: (PAD.l + w - PAD.r) / 2, y: h - 8, "text-anchor": "middle" }, xlab);
    svg(box, "text", { x: 14, y: (PAD.t + h - PAD.b) / 2, "text-anchor": "middle",
                       transform: "rotate(-90 14 " + (PAD.t + h - PAD.b) / 2 + ")" }, ylab);
  }
  // a group clipped to the plot area of a framed figure: what is drawn into it stays inside the axes
  function area(box) { return svg(box, "g", { "clip-path": "url(#" + box.id + "-area)" }); }
  function dots(box, pts, color, size, opacity) {
    if (!pts.length) return null;
    var d = pts.map(function (p) { return "M" + p[0].toFixed(1) + " " + p[1].toFixed(1) + "h0"; }).join("");
    return svg(box, "path", { d: d, stroke: color, "stroke-width": size, "stroke-linecap": "round",
                              "stroke-opacity": opacity, fill: "none" });
  }
  // a polyline through [x, y] pixel points; a null point breaks the line
  function line(box, pts, color, width, dash) {
    var d = "", pen = false;
    pts.forEach(function (p) {
      if (p === null) { pen = false; return; }
      d += (pen ? "L" : "M") + p[0].toFixed(1) + " " + p[1].toFixed(1);
      pen = true;
    });
    if (!d) return null;
    var attrs = { d: d, stroke: color, "stroke-width": width, fill: "none", "stroke-linejoin": "round" };
    if (dash) attrs["stroke-dasharray"] = dash;
    return svg(box, "path", attrs);
  }
  // light error bars: [x, yLo, yHi] pixel triples (vertical) as one path
  function bars(box, segs, color, opacity) {
    if (!segs.length) return null;
    var d = segs.map(function (s) { return "M" + s[0].toFixed(1) + " " + s[1].toFixed(1) + "V" + s[2].toFixed(1); }).join("");
    return svg(box, "path", { d: d, stroke: color, "stroke-width": 1, fill: "none", "stroke-opacity": opacity });
  }
  function chipText(color, text) { return '<span class="nf-chip" style="background:' + color + '"></span>' + esc(text); }
  function finite(values) { return values.filter(function (v) { return v !== null && v !== undefined && isFinite(v); }); }
  function extent(values) {
    var v = finite(values);
    return v.length ? [Math.min.apply(null, v), Math.max.apply(null, v)] : [0, 1];
  }

  return {
    LIMIT: LIMIT, W: W, H: H, PAD: PAD, fmt: fmt, fmtAxis: fmtAxis, esc: esc, num: num, quantile: quantile, el: el,
    pmCell: pmCell, Table: Table, svg: svg, axis: axis, xRange: xRange, yRange: yRange, frame: frame, area: area, dots: dots,
    line: line, bars: bars, chipText: chipText, finite: finite, extent: extent
  };
})();
