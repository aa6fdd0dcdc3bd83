// loraplex console: sign in once (the token stays in this tab's session storage), render the
// server's HTML fragments, and make every change through the admin API after a confirm step.
"use strict";
(function () {
  const KEY = "loraplex.console.token";
  const BASE = location.pathname.replace(/\/console\/?$/, "");
  const $ = (id) => document.getElementById(id);
  const token = () => sessionStorage.getItem(KEY) || "";
  const auth = () => ({ Authorization: "Bearer " + token() });

  function signedIn(yes, refusal) {
    $("signin").hidden = yes;
    $("nav").hidden = !yes;
    $("signout").hidden = !yes;
    $("view").hidden = !yes;
    if (!yes) {
      $("who").textContent = "";
      $("refusal").innerHTML = refusal || "";
      $("view").innerHTML = "";
      closeDialog();
    }
  }

  function signOut(refusal) {
    sessionStorage.removeItem(KEY);
    signedIn(false, refusal);
  }

  async function fragment(path) {
    const r = await fetch(BASE + "/console/view/" + path, { headers: auth(), cache: "no-store" });
    const html = await r.text();
    if (r.status === 401 || r.status === 403) {
      signOut(html);
      return null;
    }
    return html;
  }

  // Render the page the hash names. Routes may overlap (a click while a page loads): only the
  // newest one renders, and #view carries data-loading while any is in flight.
  let routes = 0, pending = 0;
  async function route() {
    if (!token()) return signedIn(false);
    const mine = ++routes;
    pending += 1;
    $("view").dataset.loading = "";
    try {
      const page = location.hash.replace(/^#/, "") || "tenants";
      const html = await fragment(page);
      if (html === null || mine !== routes) return;
      $("view").innerHTML = html;
      $("view").querySelectorAll("[data-charts]").forEach(charts);
      document.querySelectorAll("#nav a").forEach((a) => {
        a.classList.toggle("current", page.split("?")[0].replace(/^tenant$/, "tenants") === a.hash.slice(1));
      });
    } finally {
      pending -= 1;
      if (!pending) delete $("view").dataset.loading;
    }
  }

  async function signIn(value) {
    sessionStorage.setItem(KEY, value.trim());
    const html = await fragment("whoami");
    if (html === null) return;
    $("who").innerHTML = html;
    signedIn(true);
    await route();
  }

  function flash(text, kind) {
    const el = $("flash");
    el.textContent = text;
    el.className = kind || "ok";
    clearTimeout(flash.timer);
    flash.timer = setTimeout(() => { el.textContent = ""; el.className = ""; }, 8000);
  }

  function closeDialog() {
    $("dialog").hidden = true;
    $("dialog").innerHTML = "";
  }

  function query(params) {
    return Object.entries(params).filter(([, v]) => v !== "" && v !== undefined)
      .map(([k, v]) => encodeURIComponent(k) + "=" + encodeURIComponent(v)).join("&");
  }

  async function confirmStep(action, data, fields) {
    const html = await fragment("confirm?" + query({ action, slug: data.slug, alias: data.alias, ref: data.ref, ...fields }));
    if (html === null) return;
    $("dialog").innerHTML = html;
    $("dialog").hidden = false;
    const ok = $("dialog").querySelector("[data-call]");
    (ok || $("dialog").querySelector("[data-cancel]")).focus();
  }

  // The confirm step's admin API calls, in order; the first refusal stops the rest and is shown.
  async function call(button) {
    const d = button.dataset;
    const calls = JSON.parse(d.calls || "[]");
    const label = button.textContent;
    button.disabled = true;
    button.textContent = "Working…";
    try {
      for (const c of calls) {
        const headers = auth();
        if (c.body !== null) headers["Content-Type"] = "application/json";
        if (c.if_match !== null) headers["If-Match"] = '"' + c.if_match + '"';
        const r = await fetch(c.path, { method: c.method, headers, body: c.body === null ? undefined : JSON.stringify(c.body) });
        const out = await r.json().catch(() => ({}));
        if (r.status === 401 || r.status === 403) return signOut(await fragment("whoami"));
        if (!r.ok) {
          const msg = (out.error && out.error.message) || ("HTTP " + r.status);
          button.closest(".confirm").querySelector(".error").textContent = msg;
          return;
        }
      }
      // The page as it is now first, then the word that it is done (a test waiting for "Done"
      // finds the new page, not the one the dialog was opened on).
      if (location.hash !== d.back) history.pushState(null, "", d.back);
      await route();
      closeDialog();
      const done = calls.map((c) => c.method + " " + decodeURIComponent(c.path.replace(BASE, ""))).join(", then ");
      flash("Done: " + done + " (in the audit log)");
    } finally {
      button.disabled = false;
      button.textContent = label;
    }
  }

  // Charts of the live page: one SVG per metric, a line per version over the window, drawn here
  // from the numbers the page carries (no library, nothing fetched).
  const SVG = "http://www.w3.org/2000/svg";
  const COLORS = ["#2456c7", "#c75d24", "#1e7b34", "#8a2be2", "#b3261e", "#0f8b8d", "#a67c00", "#5b6475"];
  const METRICS = { requests: (p) => p[1], errors: (p) => p[2], ttft: (p) => (p[3] === null ? null : 1000 * p[3]) };

  function svg(tag, attrs, parent) {
    const el = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
    if (parent) parent.appendChild(el);
    return el;
  }

  function charts(box) {
    const series = JSON.parse(box.dataset.charts);
    const end = Number(box.dataset.now), start = end - Number(box.dataset.windowS);
    const versions = Object.keys(series);
    box.querySelectorAll("figure[data-chart]").forEach((fig) => {
      const pick = METRICS[fig.dataset.chart];
      const W = 420, H = 150, L = 44, R = 8, T = 8, B = 22;
      const counts = fig.dataset.chart !== "ttft";  // a bucket without traffic is a 0 of requests and errors
      const lines = versions.map((v) => {
        const at = new Map(series[v].map((p) => [p[0], pick(p)]));
        if (counts) for (let t = end - (end % 10) - Number(box.dataset.windowS) + 10; t <= end; t += 10) if (!at.has(t)) at.set(t, 0);
        return [...at.entries()].sort((a, b) => a[0] - b[0]).filter((p) => p[1] !== null);
      });
      const top = Math.max(1, ...lines.flat().map((p) => p[1]));
      const x = (t) => L + (W - L - R) * Math.min(1, Math.max(0, (t - start) / (end - start)));
      const y = (v) => T + (H - T - B) * (1 - v / top);
      const chart = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", class: "chart",
                                 "aria-label": fig.querySelector("figcaption").textContent });
      svg("line", { x1: L, y1: y(0), x2: W - R, y2: y(0), class: "axis" }, chart);
      for (const [v, label] of [[top, Number.isInteger(top) || top >= 10 ? top.toFixed(0) : top.toPrecision(2)], [0, "0"]]) {
        svg("text", { x: L - 4, y: y(v) + 4, "text-anchor": "end", class: "tick" }, chart).textContent = label;
      }
      svg("text", { x: L, y: H - 6, class: "tick" }, chart).textContent = "−5 min";
      svg("text", { x: W - R, y: H - 6, "text-anchor": "end", class: "tick" }, chart).textContent = "now";
      lines.forEach((pts, i) => {
        if (!pts.length) return;
        const color = COLORS[i % COLORS.length];
        const d = pts.map((p, j) => (j ? "L" : "M") + x(p[0] + 5).toFixed(1) + " " + y(p[1]).toFixed(1)).join(" ");
        svg("path", { d, fill: "none", stroke: color, "stroke-width": 2, "data-version": versions[i] }, chart);
        pts.filter((p) => !counts || p[1] > 0)
          .forEach((p) => svg("circle", { cx: x(p[0] + 5), cy: y(p[1]), r: 2.5, fill: color }, chart));
      });
      fig.appendChild(chart);
    });
    const legend = document.createElement("p");
    legend.className = "legend";
    versions.forEach((v, i) => {
      const item = document.createElement("span");
      const swatch = svg("svg", { width: 12, height: 12, viewBox: "0 0 12 12" });
      svg("rect", { width: 12, height: 12, fill: COLORS[i % COLORS.length] }, swatch);
      item.appendChild(swatch);
      item.appendChild(document.createTextNode(" " + v));
      legend.appendChild(item);
    });
    box.appendChild(legend);
  }

  async function upload(form) {
    const f = new FormData(form);
    const config = f.get("config"), weights = f.get("weights");
    const params = query({ name: f.get("name"), base_model: f.get("base_model"), owner: f.get("owner") });
    const r = await fetch(BASE + "/adapters/upload?" + params, {
      method: "POST", headers: { ...auth(), "x-loraplex-config-bytes": String(config.size) },
      body: new Blob([config, weights]),
    });
    const out = await r.json().catch(() => ({}));
    if (r.ok) { flash("Uploaded " + out.label + " (" + out.status + ")"); await route(); }
    else flash((out.error && out.error.message) || ("upload failed: HTTP " + r.status), "error");
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("signin-form").addEventListener("submit", (e) => { e.preventDefault(); signIn($("token").value); $("token").value = ""; });
    $("signout").addEventListener("click", () => signOut());
    window.addEventListener("hashchange", route);
    document.addEventListener("submit", (e) => {
      const form = e.target;
      if (form.id === "signin-form") return;
      e.preventDefault();
      const fields = Object.fromEntries(new FormData(form).entries());
      if (form.dataset.search !== undefined) {
        location.hash = form.dataset.search + "?" + query(fields);
      } else if (form.dataset.confirm) {
        confirmStep(form.dataset.confirm, form.dataset, fields);
      } else if (form.dataset.upload !== undefined) {
        upload(form);
      }
    });
    document.addEventListener("click", (e) => {
      const el = e.target.closest("button");
      if (!el || el.type === "submit") return;
      if (el.dataset.confirm) confirmStep(el.dataset.confirm, el.dataset, {});
      else if (el.dataset.call !== undefined) call(el);
      else if (el.dataset.cancel !== undefined) closeDialog();
    });
    document.addEventListener("keydown", (e) => { if (e.key === "Escape") closeDialog(); });
    if (token()) signIn(token()); else signedIn(false);
  });
})();
