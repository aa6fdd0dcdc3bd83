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

  async function route() {
    if (!token()) return signedIn(false);
    const page = location.hash.replace(/^#/, "") || "tenants";
    const html = await fragment(page);
    if (html === null) return;
    $("view").innerHTML = html;
    document.querySelectorAll("#nav a").forEach((a) => {
      a.classList.toggle("current", page.split("?")[0].replace(/^tenant$/, "tenants") === a.hash.slice(1));
    });
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
    const html = await fragment("confirm?" + query({ action, slug: data.slug, alias: data.alias, ...fields }));
    if (html === null) return;
    $("dialog").innerHTML = html;
    $("dialog").hidden = false;
    const ok = $("dialog").querySelector("[data-call]");
    (ok || $("dialog").querySelector("[data-cancel]")).focus();
  }

  async function call(button) {
    const d = button.dataset;
    const headers = auth();
    if (d.body) headers["Content-Type"] = "application/json";
    if (d.ifMatch) headers["If-Match"] = '"' + d.ifMatch + '"';
    button.disabled = true;
    try {
      const r = await fetch(d.path, { method: d.method, headers, body: d.body || undefined });
      const out = await r.json().catch(() => ({}));
      if (r.status === 401 || r.status === 403) return signOut(await fragment("whoami"));
      if (!r.ok) {
        const msg = (out.error && out.error.message) || ("HTTP " + r.status);
        button.closest(".confirm").querySelector(".error").textContent = msg;
        return;
      }
      closeDialog();
      flash("Done: " + d.method + " " + d.path.replace(BASE, "") + " (in the audit log)");
      if (location.hash === d.back) await route(); else location.hash = d.back;
    } finally {
      button.disabled = false;
    }
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
