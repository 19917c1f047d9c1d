// The console's only script: every page part marked data-live="MS" is fetched again every
// MS milliseconds (the same URL, asking for that part only) and swapped in, so a rollout's
// progress moves without a reload. Nothing else: forms are plain HTML forms.
(function () {
  "use strict";
  var live = document.querySelector("[data-live]");
  if (!live) { return; }
  var every = Number(live.getAttribute("data-live")) || 2000;
  function tick() {
    fetch(window.location.href, {headers: {"X-Console-Part": "live"},
                                 credentials: "same-origin", cache: "no-store"})
      .then(function (r) {
        if (r.redirected || !r.ok) { return null; }  // signed out or gone: leave it be
        return r.text();
      })
      .then(function (html) {
        if (html !== null && !live.contains(document.activeElement)) {
          live.innerHTML = html;
          live.setAttribute("data-updated", String(Date.now()));
        }
      })
      .catch(function () { /* the controller restarting: try again next time */ })
      .then(function () { window.setTimeout(tick, every); });
  }
  window.setTimeout(tick, every);
}());
