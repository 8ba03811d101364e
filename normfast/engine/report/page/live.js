/* normfast serve: the interactive page's script. Sends the typed texts to POST /api/view and shows
   the answer -- the page `normfast view` writes for a run -- in the frame below. Plain JavaScript. */
(function () {
  "use strict";
  var CONF = JSON.parse(document.getElementById("nf-data").textContent).conf;
  var input = document.getElementById("nf-input"), go = document.getElementById("nf-go");
  var status = document.getElementById("nf-live-status"), frame = document.getElementById("nf-result");
  var busy = false;

  function say(text, error) {
    status.textContent = text;
    status.classList.toggle("nf-error", !!error);
  }
  function texts() {
    return input.value.split(/\r?\n/).map(function (t) { return t.trim(); }).filter(function (t) { return t; });
  }
  function probe() {
    if (busy) return;
    var list = texts();
    if (!list.length) { say("type a text first", true); return; }
    if (list.length > CONF.max_texts) { say(list.length + " lines: at most " + CONF.max_texts + " at once", true); return; }
    busy = true; go.disabled = true; document.body.dataset.ready = "0";
    say("probing " + list.length + (list.length === 1 ? " text" : " texts") + " ...");
    var t0 = performance.now();
    fetch(CONF.view_url, { method: "POST", headers: { "Content-Type": "application/json" },
                           body: JSON.stringify({ texts: list }) })
      .then(function (r) {
        if (r.ok) return r.text().then(function (html) { return { html: html }; });
        return r.json().then(function (j) { return { error: r.status + ": " + (j.error || r.statusText) }; },
                             function () { return { error: r.status + ": " + r.statusText }; });
      })
      .then(function (got) {
        if (got.error) { say(got.error, true); document.body.dataset.ready = "error"; return; }
        frame.onload = function () { document.body.dataset.ready = "1"; };
        frame.srcdoc = got.html;
        say("probed " + list.length + (list.length === 1 ? " text" : " texts") + " in " +
            ((performance.now() - t0) / 1000).toFixed(2) + " s; hover a token for its numbers");
      })
      .catch(function (e) { say("the service did not answer (" + e + ")", true); document.body.dataset.ready = "error"; })
      .then(function () { busy = false; go.disabled = false; });
  }
  go.addEventListener("click", probe);
  input.addEventListener("keydown", function (ev) {
    if (ev.key === "Enter" && (ev.ctrlKey || ev.metaKey)) { ev.preventDefault(); probe(); }
  });
  document.body.dataset.ready = "idle";
  if (CONF.probe_on_load && texts().length) probe();
})();
