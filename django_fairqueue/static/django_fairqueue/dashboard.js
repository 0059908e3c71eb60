/* django-fairqueue admin dashboard: draws the charts as SVG and refreshes them from the JSON
 * endpoint (same origin, the admin session's cookie). No library, no network beyond that. */
(function () {
  "use strict";

  var SVG = "http://www.w3.org/2000/svg";
  var root = document.getElementById("fq-dashboard");
  if (!root) {
    return;
  }
  var dataUrl = root.getAttribute("data-url");
  var refresh = Math.max(parseFloat(root.getAttribute("data-refresh")) || 5, 1) * 1000;
  var channelUrl = root.getAttribute("data-channel-url");
  var messageUrl = root.getAttribute("data-message-url");
  var statusEl = document.getElementById("fq-status");
  var timer = null;

  function fmtInt(n) {
    return n === null || n === undefined ? "-" : Number(n).toLocaleString("en-US");
  }

  function fmtMs(ms) {
    if (ms === null || ms === undefined) {
      return "-";
    }
    if (ms < 1000) {
      return Math.round(ms) + " ms";
    }
    return (ms / 1000).toFixed(ms < 10000 ? 2 : 1) + " s";
  }

  function fmtAge(s) {
    if (s === null || s === undefined) {
      return "-";
    }
    s = Math.floor(s);
    function two(n) {
      return (n < 10 ? "0" : "") + n;
    }
    if (s < 60) {
      return s + "s";
    }
    if (s < 3600) {
      return Math.floor(s / 60) + "m " + two(s % 60) + "s";
    }
    if (s < 86400) {
      return Math.floor(s / 3600) + "h " + two(Math.floor((s % 3600) / 60)) + "m";
    }
    return Math.floor(s / 86400) + "d " + two(Math.floor((s % 86400) / 3600)) + "h";
  }

  function el(name, attrs, parent) {
    var node = document.createElementNS(SVG, name);
    Object.keys(attrs || {}).forEach(function (k) {
      node.setAttribute(k, attrs[k]);
    });
    if (parent) {
      parent.appendChild(node);
    }
    return node;
  }

  function text(parent, x, y, value, attrs) {
    var t = el("text", Object.assign({ x: x, y: y }, attrs || {}), parent);
    t.textContent = value;
    return t;
  }

  function clear(container) {
    while (container.firstChild) {
      container.removeChild(container.firstChild);
    }
  }

  function empty(container, message) {
    clear(container);
    var p = document.createElement("p");
    p.className = "fq-empty";
    p.textContent = message;
    container.appendChild(p);
  }

  /* Horizontal bars, one row per item: item.parts = [{value, cls, label}], stacked; item.mark
   * draws a vertical tick (e.g. the concurrency cap). */
  function barChart(container, items, opts) {
    clear(container);
    if (!items.length) {
      empty(container, opts.emptyText || "Nothing to show.");
      return;
    }
    var row = 18;
    var labelW = 150;
    var valueW = opts.valueWidth || 90;
    var width = Math.max(container.clientWidth || 520, 360);
    var plotW = width - labelW - valueW;
    var height = items.length * row + 6;
    var max = 0;
    items.forEach(function (it) {
      var sum = it.parts.reduce(function (a, p) {
        return a + p.value;
      }, 0);
      max = Math.max(max, sum, it.mark || 0);
    });
    max = max || 1;
    var svg = el("svg", {
      width: width,
      height: height,
      viewBox: "0 0 " + width + " " + height,
      role: "img",
      "aria-label": opts.title || "",
      class: "fq-svg",
    });
    items.forEach(function (it, i) {
      var y = i * row + 3;
      var label = text(svg, labelW - 6, y + 12, it.label, { "text-anchor": "end", class: "fq-label" });
      if (it.href) {
        var a = el("a", { href: it.href }, svg);
        a.appendChild(label);
      }
      var x = labelW;
      it.parts.forEach(function (p) {
        var w = (p.value / max) * plotW;
        if (w > 0) {
          var r = el("rect", { x: x, y: y + 2, width: Math.max(w, 1), height: row - 6, class: p.cls }, svg);
          var t = el("title", {}, r);
          t.textContent = it.label + ": " + p.label + " " + fmtInt(p.value);
          x += w;
        }
      });
      if (it.mark) {
        var mx = labelW + (it.mark / max) * plotW;
        el("line", { x1: mx, x2: mx, y1: y, y2: y + row - 2, class: "fq-mark" }, svg);
      }
      text(svg, labelW + plotW + 6, y + 12, it.valueText, { class: "fq-value" });
    });
    container.appendChild(svg);
  }

  /* Lines over time: series = [{name, cls, values: [number|null]}], labels = [string]. */
  function lineChart(container, labels, series, opts) {
    clear(container);
    var any = series.some(function (s) {
      return s.values.some(function (v) {
        return v !== null;
      });
    });
    if (!any) {
      empty(container, opts.emptyText);
      return;
    }
    var width = Math.max(container.clientWidth || 900, 360);
    var height = 200;
    var left = 64;
    var bottom = 22;
    var top = 10;
    var plotW = width - left - 130;
    var plotH = height - top - bottom;
    var max = 0;
    series.forEach(function (s) {
      s.values.forEach(function (v) {
        if (v !== null) {
          max = Math.max(max, v);
        }
      });
    });
    max = max || 1;
    var svg = el("svg", { width: width, height: height, viewBox: "0 0 " + width + " " + height, role: "img", "aria-label": opts.title, class: "fq-svg" });
    [0, 0.5, 1].forEach(function (f) {
      var y = top + plotH - f * plotH;
      el("line", { x1: left, x2: left + plotW, y1: y, y2: y, class: "fq-grid-line" }, svg);
      text(svg, left - 6, y + 4, fmtMs(max * f), { "text-anchor": "end", class: "fq-axis" });
    });
    var n = labels.length;
    function xAt(i) {
      return left + (n > 1 ? (i / (n - 1)) * plotW : plotW / 2);
    }
    [0, Math.floor((n - 1) / 2), n - 1].forEach(function (i) {
      if (i >= 0 && i < n) {
        text(svg, xAt(i), height - 6, labels[i], { "text-anchor": "middle", class: "fq-axis" });
      }
    });
    series.forEach(function (s, k) {
      var d = "";
      var pen = false;
      s.values.forEach(function (v, i) {
        if (v === null) {
          pen = false;
          return;
        }
        var y = top + plotH - (v / max) * plotH;
        d += (pen ? " L " : " M ") + xAt(i).toFixed(1) + " " + y.toFixed(1);
        pen = true;
        var c = el("circle", { cx: xAt(i), cy: y, r: 2.5, class: s.cls }, svg);
        el("title", {}, c).textContent = labels[i] + " " + s.name + ": " + fmtMs(v);
      });
      // a line, not a shape: never filled, whatever the stylesheet says about its colour class
      el("path", { d: d.trim(), class: s.cls + " fq-line", fill: "none" }, svg);
      text(svg, left + plotW + 12, top + 14 + k * 18, s.name, { class: s.cls + " fq-legend" });
    });
    container.appendChild(svg);
  }

  function tenantHref(t) {
    return channelUrl + t.id + "/change/";
  }

  /* A channel as people read it: its name, with its queue outside the default one. */
  function tenantLabel(t) {
    return t.queue && t.queue !== "default" ? t.name + " [" + t.queue + "]" : t.name;
  }

  function renderCards(data) {
    var cards = document.getElementById("fq-cards");
    var t = data.totals;
    var f = data.fairness;
    // the fleet: live workers, and a running count that no live worker renews
    var live = data.workers ? data.workers.live : null;
    var noWorker = live === 0 && t.running > 0;
    var runningLabel = noWorker
      ? "running: no live worker"
      : data.expired_leases
      ? "running, " + fmtInt(data.expired_leases) + " lease expired"
      : "running";
    var items = [
      [fmtInt(live), "live workers", live === 0],
      [fmtInt(t.backlogged) + " / " + fmtInt(t.channels), "channels backlogged"],
      [fmtInt(t.ready), "ready"],
      [fmtInt(t.running), runningLabel, noWorker || data.expired_leases > 0],
      [fmtInt(t.failures_last_5m), "failures, 5 min"],
      [fmtInt(t.timeouts_last_5m), "timeouts, 5 min"],
      [fmtInt(t.retrying), "retrying"],
      [fmtInt(t.failed), "dead letters"],
      [f.index === null ? "-" : f.index.toFixed(3), "fairness (Jain's index)"],
      [fmtMs(data.wait.p50_ms) + " / " + fmtMs(data.wait.p95_ms), "wait p50 / p95, " + data.window_minutes + " min"],
    ];
    clear(cards);
    items.forEach(function (item) {
      var card = document.createElement("div");
      card.className = item[2] ? "fq-card fq-card-warn" : "fq-card";
      var v = document.createElement("span");
      v.className = "fq-card-value";
      v.textContent = item[0];
      var l = document.createElement("span");
      l.className = "fq-card-label";
      l.textContent = item[1];
      card.appendChild(v);
      card.appendChild(l);
      cards.appendChild(card);
    });
  }

  /* Why a tenant's running count runs nothing: no live worker, or leases expired. */
  function staleText(data, t) {
    if (t.running > 0 && data.workers && data.workers.live === 0) {
      return " (no live worker)";
    }
    return t.expired_leases ? " (" + fmtInt(t.expired_leases) + " lease expired)" : "";
  }

  function renderTable(data) {
    var body = document.querySelector("#fq-table tbody");
    clear(body);
    data.tenants.forEach(function (t) {
      var tr = document.createElement("tr");
      var cells = [
        null,
        t.queue,
        fmtInt(t.ready),
        fmtInt(t.delayed),
        fmtInt(t.retrying),
        fmtInt(t.running) + " / " + (t.max_concurrency === null ? "∞" : fmtInt(t.max_concurrency)) +
          staleText(data, t),
        fmtInt(t.failures_last_5m),
        fmtInt(t.timeouts_last_5m),
        null,
        fmtInt(t.served) + (data.served ? " (" + (100 * t.served_share).toFixed(1) + " %)" : ""),
        t.wait ? fmtMs(t.wait.p50_ms) : "-",
        t.wait ? fmtMs(t.wait.p95_ms) : "-",
        fmtAge(t.oldest_ready_age_seconds),
        fmtInt(t["finished_last_5m"]),
      ];
      cells.forEach(function (c, i) {
        var td = document.createElement("td");
        if (i === 0) {
          var a = document.createElement("a");
          a.href = tenantHref(t);
          a.textContent = t.name;
          td.appendChild(a);
          if (t.paused) {
            var badge = document.createElement("span");
            badge.className = "fq-badge fq-paused";
            badge.textContent = "paused";
            td.appendChild(document.createTextNode(" "));
            td.appendChild(badge);
          }
        } else if (i === 8) {
          if (t.failed > 0) {
            var f = document.createElement("a");
            f.href = messageUrl + "?channel__id__exact=" + t.id + "&state__exact=failed";
            f.textContent = fmtInt(t.failed);
            td.appendChild(f);
          } else {
            td.textContent = "0";
          }
        } else {
          td.textContent = c;
        }
        tr.appendChild(td);
      });
      body.appendChild(tr);
    });
  }

  function runningClass(t) {
    if (t.max_concurrency !== null && t.running > t.max_concurrency) {
      return "fq-over-cap-bar";
    }
    if (t.max_concurrency !== null && t.running === t.max_concurrency) {
      return "fq-at-cap-bar";
    }
    return "fq-running";
  }

  function render(data) {
    renderCards(data);
    var tenants = data.tenants;
    var noLive = data.workers ? data.workers.live === 0 : false;
    barChart(
      document.getElementById("fq-chart-backlog"),
      tenants.map(function (t) {
        return {
          label: tenantLabel(t),
          href: tenantHref(t),
          parts: [
            { value: t.ready, cls: "fq-ready", label: "ready" },
            { value: t.delayed, cls: "fq-delayed", label: "delayed" },
            { value: t.retrying, cls: "fq-retrying-bar", label: "retrying" },
          ],
          valueText: fmtInt(t.ready + t.scheduled),
        };
      }),
      { title: "Backlog per tenant", emptyText: "No channels." }
    );
    barChart(
      document.getElementById("fq-chart-running"),
      tenants.map(function (t) {
        return {
          label: tenantLabel(t),
          href: tenantHref(t),
          // over its cap red, at it orange; leases no live worker renews grey
          parts: [
            {
              value: noLive ? 0 : t.running - t.expired_leases,
              cls: runningClass(t),
              label: "running",
            },
            {
              value: noLive ? t.running : t.expired_leases,
              cls: "fq-running-stale",
              label: noLive ? "no live worker" : "lease expired",
            },
          ],
          mark: t.max_concurrency,
          valueText: fmtInt(t.running) + " / " + (t.max_concurrency === null ? "∞" : fmtInt(t.max_concurrency)),
        };
      }),
      { title: "Running vs max concurrency", emptyText: "No channels." }
    );
    // The failing channels of the whole queue (chosen by the server), not of the tenants above.
    barChart(
      document.getElementById("fq-chart-failed"),
      (data.failing || []).map(function (t) {
        return {
          label: tenantLabel(t),
          href: tenantHref(t),
          parts: [
            { value: t.failures_last_5m, cls: "fq-failed-bar", label: "failures, 5 min" },
            { value: t.timeouts_last_5m, cls: "fq-timeout-bar", label: "timeouts, 5 min" },
            { value: t.retrying, cls: "fq-retrying-bar", label: "retrying" },
            { value: t.failed, cls: "fq-dead-bar", label: "dead letters" },
          ],
          valueText:
            fmtInt(t.failures_last_5m) + " / " + fmtInt(t.timeouts_last_5m) + " / " +
            fmtInt(t.retrying) + " / " + fmtInt(t.failed),
        };
      }),
      { title: "Failing now", valueWidth: 190, emptyText: "No channel is failing: no failures or timeouts in the last 5 minutes, no retries waiting, no dead letters." }
    );
    barChart(
      document.getElementById("fq-chart-served"),
      tenants.map(function (t) {
        return {
          label: tenantLabel(t),
          href: tenantHref(t),
          parts: [{ value: t.served, cls: "fq-served", label: "served" }],
          valueText: data.served ? (100 * t.served_share).toFixed(1) + " %" : "-",
        };
      }),
      { title: "Served share", emptyText: "No channels." }
    );
    var labels = data.series.map(function (m) {
      return m.minute.substr(11, 5);
    });
    lineChart(
      document.getElementById("fq-chart-wait"),
      labels,
      [
        { name: "p50", cls: "fq-p50", values: data.series.map(function (m) { return m.wait.p50_ms; }) },
        { name: "p95", cls: "fq-p95", values: data.series.map(function (m) { return m.wait.p95_ms; }) },
      ],
      { title: "Wait p50 and p95 per minute", emptyText: "No claims recorded in the last " + labels.length + " minutes." }
    );
    renderTable(data);
    statusEl.textContent = "as of " + data.generated_at.substr(11, 8) + " UTC, refreshing every " + refresh / 1000 + " s";
  }

  function poll() {
    fetch(dataUrl + window.location.search, {
      credentials: "same-origin",
      headers: { Accept: "application/json" },
    })
      .then(function (response) {
        var type = response.headers.get("Content-Type") || "";
        if (!response.ok || type.indexOf("application/json") === -1) {
          // A redirect to the login page (session expired) or an error: stop, say so.
          throw new Error(response.redirected ? "signed out: reload the page" : "HTTP " + response.status);
        }
        return response.json();
      })
      .then(function (data) {
        render(data);
        timer = window.setTimeout(poll, refresh);
      })
      .catch(function (err) {
        statusEl.textContent = "refresh stopped (" + err.message + ")";
        statusEl.classList.add("fq-error-text");
      });
  }

  var initial = document.getElementById("fq-initial");
  if (initial) {
    render(JSON.parse(initial.textContent));
  }
  timer = window.setTimeout(poll, refresh);
  window.addEventListener("beforeunload", function () {
    if (timer) {
      window.clearTimeout(timer);
    }
  });
})();
