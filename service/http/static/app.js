// The snca page: plain JavaScript against the service's own HTTP API (no build step).
"use strict";

const $ = (id) => document.getElementById(id);
const thumbCache = new Map(); // thumbnail URL -> object URL

function apiKey() { return $("apikey").value.trim(); }

// The gallery_version of this page's last write: sent back on every request, so that behind a
// load balancer the page reads its own writes on whichever replica answers.
let lastWrite = 0;

function headers() {
  const h = {};
  if (apiKey()) h["X-API-Key"] = apiKey();
  if (lastWrite > 0) h["X-Min-Gallery-Version"] = String(lastWrite);
  return h;
}

function say(text, ok = false) {
  const m = $("message");
  m.textContent = text;
  m.className = ok ? "ok" : "";
  m.hidden = !text;
}

// fetch + JSON, turning the service's {"detail": ...} errors into readable messages.
async function api(path, options = {}) {
  let resp;
  try {
    resp = await fetch(path, { ...options, headers: { ...headers(), ...(options.headers || {}) } });
  } catch (e) {
    throw new Error(`cannot reach the service (${e.message})`);
  }
  let body = null;
  try { body = await resp.json(); } catch (_) { /* not JSON */ }
  const method = (options.method || "GET").toUpperCase();
  if (resp.ok && method !== "GET" && body && Number.isInteger(body.gallery_version)
      && !path.startsWith("/classify") && !path.startsWith("/search")) {
    lastWrite = Math.max(lastWrite, body.gallery_version);
  }
  if (!resp.ok) {
    const detail = body && body.detail ? body.detail : resp.statusText;
    const hint = resp.status === 401 ? " — enter the server's API key at the top right" : "";
    throw new Error(`${resp.status}: ${detail}${hint}`);
  }
  return body;
}

async function thumbnail(url) {
  if (!url) return null;
  if (thumbCache.has(url)) return thumbCache.get(url);
  const resp = await fetch(url, { headers: headers() });
  if (!resp.ok) return null;
  const obj = URL.createObjectURL(await resp.blob());
  thumbCache.set(url, obj);
  return obj;
}

function cell(item) {
  const div = document.createElement("div");
  div.className = "cell";
  div.dataset.id = item.id;
  const ph = document.createElement("span");
  ph.className = "noimg";
  ph.textContent = "no preview";
  div.append(ph);
  const sim = document.createElement("div");
  sim.innerHTML = "";
  // the label, editable in place (PATCH /gallery/items/{id}: a correction, one write)
  const lab = document.createElement("button");
  lab.type = "button";
  lab.className = "cell-label";
  lab.textContent = item.label;
  lab.title = "change this item's label";
  lab.disabled = access !== "write";
  lab.addEventListener("click", () => relabelItem(item.id, lab));
  // (a queued query's id is 16 digits: its end shown, the whole in the tooltip)
  const id = String(item.id);
  const idText = document.createElement("span");
  idText.className = "cell-id";
  idText.textContent = `#${id.length > 8 ? "…" + id.slice(-6) : id}`;
  idText.title = `#${id}`;
  const note = item.similarity == null ? (item.note ?? "") : item.similarity.toFixed(3);
  sim.append(lab, document.createElement("br"), `${note} · `, idText);
  div.append(sim);
  thumbnail(item.thumbnail_url).then((src) => {
    if (!src) return;
    const img = document.createElement("img");
    img.src = src;
    img.alt = item.label;
    ph.replaceWith(img);
  });
  return div;
}

function pct(p) { return `${(100 * p).toFixed(1)}%`; }

// ---------------------------------------------------------------- tabs
function showTab(name) {
  for (const b of document.querySelectorAll("nav button")) {
    b.setAttribute("aria-selected", String(b.dataset.tab === name));
  }
  for (const s of document.querySelectorAll("section.tab")) s.hidden = s.id !== `tab-${name}`;
  say("");
  if (name === "labels") loadLabels();
  if (name === "review") loadReview();
}

// ---------------------------------------------------------------- classify
async function classify(file) {
  say("");
  batchRun += 1; // (a batch still running stops)
  $("classify-batch").hidden = true;
  const fd = new FormData();
  fd.append("image", file);
  const q = new URLSearchParams({ k: $("classify-k").value || "30", vote: $("classify-vote").value, neighbors: "true" });
  const old = $("classify-preview").src;
  if (old.startsWith("blob:")) URL.revokeObjectURL(old);
  $("classify-preview").src = URL.createObjectURL(file);
  try {
    const r = await api(`/classify?${q}`, { method: "POST", body: fd });
    $("classify-result").hidden = false;
    // an unknown answer has no label: the page shows the nearest one, marked as a guess
    $("classify-label").textContent = r.label ?? r.nearest_label ?? "(empty gallery)";
    // an unknown answer names no label: the nearest one is shown as a guess, with no confidence
    $("classify-confidence").textContent = r.unknown || r.confidence == null ? "" : pct(r.confidence);
    $("classify-explanation").textContent = r.explanation;
    $("classify-unknown").hidden = !r.unknown;
    $("classify-closest").hidden = !r.unknown; // the label is then only the closest, not an answer
    $("classify-unknown-box").hidden = !r.unknown;
    lastClassified = file;
    const score = r.unknown_score == null ? "" : `open-set score ${r.unknown_score.toFixed(3)}`;
    const thr = r.unknown_threshold == null ? "" : ` (threshold ${r.unknown_threshold.toFixed(3)} at ${pct(r.unknown_tpr)} of known images accepted)`;
    const world = r.world_score == null ? "" : `; world distance ${r.world_score.toFixed(2)} (limit ${r.world_threshold.toFixed(2)}, ${r.world_basis === "label" ? "from the label's own images" : "from the training images"})`;
    $("classify-score").textContent = score + thr + world;
    $("classify-unknown-reason").textContent = r.unknown_reason ? `unknown_reason: ${r.unknown_reason}; vote ${r.vote}, k ${r.k}` : `vote ${r.vote}, k ${r.k}`;
    const probs = $("classify-probs");
    probs.replaceChildren(...r.probabilities.map((p) => {
      const li = document.createElement("li");
      const bar = document.createElement("span");
      bar.className = "bar";
      bar.style.width = `${Math.max(2, 120 * p.probability)}px`;
      li.append(`${p.label} ${pct(p.probability)}`, bar);
      return li;
    }));
    const nb = (r.neighbors || []).slice(0, 10);
    $("classify-neighbours-title").hidden = nb.length === 0;
    $("classify-neighbours-title").textContent = r.unknown
      ? "Nearest gallery items (none of them is like this image)"
      : "Nearest gallery items";
    $("classify-neighbours").replaceChildren(...nb.map(cell));
    refreshStatus();
  } catch (e) {
    // no previous prediction left beside a new (maybe broken) preview
    $("classify-result").hidden = true;
    $("classify-preview").removeAttribute("src");
    $("classify-label").textContent = "";
    $("classify-score").textContent = "";
    $("classify-unknown-box").hidden = true;
    lastClassified = null;
    $("classify-probs").replaceChildren();
    $("classify-neighbours").replaceChildren();
    say(e.message);
  }
}

// Several images at once (picked, dropped or pasted): one row each, classified one after the
// other (the service batches what arrives together anyway), at most BATCH_MAX a go.
const BATCH_MAX = 200;
let batchRun = 0; // a newer batch stops an older one
async function classifyMany(files) {
  if (files.length === 1) return classify(files[0]);
  say(files.length > BATCH_MAX ? `${files.length} images: the first ${BATCH_MAX} are classified` : "");
  files = files.slice(0, BATCH_MAX);
  const run = ++batchRun;
  $("classify-result").hidden = true;
  $("classify-neighbours-title").hidden = true;
  $("classify-neighbours").replaceChildren();
  $("classify-batch").hidden = false;
  const body = $("classify-batch-table").tBodies[0];
  for (const u of body.querySelectorAll("img")) URL.revokeObjectURL(u.src);
  const rows = files.map((f) => {
    const tr = document.createElement("tr");
    const img = document.createElement("img");
    img.className = "batch-thumb";
    img.alt = f.name || "pasted image";
    img.src = URL.createObjectURL(f);
    const cells = [img, f.name || "pasted image", "…", ""].map((v) => {
      const td = document.createElement("td");
      td.append(v);
      return td;
    });
    tr.append(...cells);
    return tr;
  });
  body.replaceChildren(...rows);
  const counts = { named: 0, unknown: 0, failed: 0 };
  for (const [i, f] of files.entries()) {
    if (run !== batchRun) return;
    $("classify-batch-progress").textContent = `${i} of ${files.length} classified…`;
    const [, , answer, why] = rows[i].children;
    const fd = new FormData();
    fd.append("image", f);
    try {
      const r = await api("/classify", { method: "POST", body: fd });
      if (r.unknown || r.label == null) {
        counts.unknown += 1;
        answer.textContent = r.nearest_label == null ? "unknown" : `unknown (nearest label ${r.nearest_label})`;
        rows[i].className = "unknown";
      } else {
        counts.named += 1;
        answer.textContent = `${r.label} (${pct(r.confidence)})`;
      }
      why.textContent = r.explanation;
    } catch (e) {
      counts.failed += 1;
      answer.textContent = "not classified";
      why.textContent = e.message;
      rows[i].className = "failed";
    }
  }
  $("classify-batch-progress").textContent = `${files.length} classified: ${counts.named} named, ${counts.unknown} unknown` + (counts.failed ? `, ${counts.failed} could not be read` : "");
  refreshStatus();
}

// A pasted image (Ctrl+V anywhere on the Classify tab, outside a text field) is classified.
function onPaste(e) {
  if ($("tab-classify").hidden) return;
  const t = e.target;
  if (t && (t.tagName === "INPUT" || t.tagName === "TEXTAREA") && t.type !== "file") return;
  const files = [...(e.clipboardData?.files || [])].filter((f) => f.type.startsWith("image/"));
  if (!files.length) {
    say("Nothing to classify in what was pasted: copy an image (not its address), then paste.");
    return;
  }
  e.preventDefault();
  classifyMany(files);
}

// ---------------------------------------------------------------- register
let lastClassified = null; // the image last classified (carried to the registration tab)

// "Register this image as a new label": the classified image goes to the registration form.
function carryToRegister() {
  if (!lastClassified) return;
  const dt = new DataTransfer();
  dt.items.add(lastClassified);
  $("register-files").files = dt.files;
  $("register-carried").textContent = `1 image carried over from Classify (${lastClassified.name || "image"}); name the new label, add more images of it if you have them.`;
  $("register-carried").hidden = false;
  showTab("register");
  $("register-label").focus();
}

function showDiagnostics(d) {
  const warnings = $("register-warnings");
  const facts = $("register-facts");
  if (!d) { warnings.replaceChildren(); facts.replaceChildren(); return; }
  warnings.replaceChildren(...(d.warnings.length ? d.warnings : ["no warnings"]).map((w) => {
    const li = document.createElement("li");
    li.textContent = w;
    if (d.warnings.length) li.className = "warning";
    return li;
  }));
  const rows = [
    ["images checked", String(d.checked)],
    ["leave-one-out agreement", d.agreement == null ? "— (one image)" : pct(d.agreement)],
    ["cohesion (mean cosine within the label)", d.cohesion == null ? "—" : d.cohesion.toFixed(3)],
    ["typical cohesion of the gallery's labels", d.gallery_cohesion == null ? "—" : d.gallery_cohesion.toFixed(3)],
    ["nearest other label", d.nearest_label == null ? "—" : `${d.nearest_label} (cosine ${d.nearest_similarity.toFixed(3)})`],
    ["suspected outliers", d.outliers.length ? d.outliers.map((o) => `#${o.id} → ${o.sits_with} (${pct(o.probability)})`).join(", ") : "none"],
  ];
  facts.replaceChildren(...rows.flatMap(([k, v]) => {
    const dt = document.createElement("dt");
    dt.textContent = k;
    const dd = document.createElement("dd");
    dd.textContent = v;
    return [dt, dd];
  }));
}

async function register(ev) {
  ev.preventDefault();
  say("");
  const files = $("register-files").files;
  const label = $("register-label").value.trim();
  if (!label) return say("enter a label");
  if (!files.length) return say("pick at least one image");
  const fd = new FormData();
  fd.append("label", label);
  for (const f of files) fd.append("images", f);
  const md = $("register-metadata").value.trim();
  if (md) fd.append("metadata", md);
  $("register-submit").disabled = true;
  try {
    const r = await api("/gallery/add", { method: "POST", body: fd });
    $("register-summary").textContent = `Registered ${r.ids.length} image(s) as "${r.label}" (now ${r.count}; ids ${r.ids.join(", ")}).`;
    const check = new FormData();
    check.append("image", files[0]);
    const c = await api("/classify", { method: "POST", body: check });
    // an unknown answer gets no percentage: its nearest label is a guess, not an answer
    $("register-check").textContent = c.unknown
      ? `still unknown (nearest label ${c.nearest_label})`
      : `${c.label} (${pct(c.confidence)} likely right)`;
    showDiagnostics(r.diagnostics);
    $("register-carried").hidden = true;
    $("register-result").hidden = false;
    say(`"${r.label}" is in the gallery`, true);
    refreshStatus();
  } catch (e) {
    say(e.message);
  } finally {
    $("register-submit").disabled = access !== "write";
  }
}

// ---------------------------------------------------------------- labels
// ---------------------------------------------------------------- learn (issue 52)
let learnTimer = null;
async function loadLearn() {
  try {
    const r = await api("/admin/learn");
    const n = r.unlearned ? r.unlearned.items : null;
    $("learn-summary").textContent = r.running
      ? "Learning: the model is being retrained on the gallery (it switches when the new one is not worse)."
      : (n === null ? "" : `${n} item${n === 1 ? "" : "s"} the model has not learned from.`);
    $("learn-log").hidden = !r.log.length;
    $("learn-log").textContent = r.log.join("\n");
    $("learn-start").dataset.running = r.running ? "1" : "";
    applyAccess();
    clearTimeout(learnTimer);
    if (r.running) learnTimer = setTimeout(loadLearn, 2000);
  } catch (e) {
    $("learn-summary").textContent = e.message;
  }
}

async function startLearn() {
  try {
    await api("/admin/learn", { method: "POST" });
    say("Learning started: the log below follows it.");
  } catch (e) {
    say(e.message);
  }
  loadLearn();
}

async function loadLabels() {
  loadLearn();
  try {
    // every page (the service answers up to 1,000 labels a page)
    const all = [];
    let token = null;
    do {
      const q = new URLSearchParams({ limit: "10000", ...(token ? { page_token: token } : {}) });
      const r = await api(`/gallery/labels?${q}`);
      all.push(...r.labels);
      token = r.next_page_token;
    } while (token);
    const rows = all.map((l) => {
      const tr = document.createElement("tr");
      tr.dataset.label = l.label;
      for (const v of [l.label, String(l.count), l.source]) {
        const td = document.createElement("td");
        td.textContent = v;
        tr.append(td);
      }
      const checks = document.createElement("td");
      checks.className = "checks muted";
      checks.textContent = "…";
      tr.append(checks);
      const td = document.createElement("td");
      const its = document.createElement("button");
      its.textContent = "items";
      its.className = "read";
      its.addEventListener("click", () => loadItems(l.label));
      const sug = document.createElement("button");
      sug.textContent = "suggestions";
      sug.className = "read";
      sug.addEventListener("click", () => loadSuggestions(l.label));
      const ren = document.createElement("button");
      ren.textContent = "rename";
      ren.addEventListener("click", () => renameLabel(l.label, all.map((x) => x.label)));
      const b = document.createElement("button");
      b.textContent = "delete";
      b.addEventListener("click", () => deleteLabel(l.label, l.count));
      td.append(its, " ", sug, " ", ren, " ", b);
      tr.append(td);
      return tr;
    });
    $("labels-table").tBodies[0].replaceChildren(...rows);
    applyAccess();
    labelChecks(rows, ++labelsShown);
  } catch (e) {
    say(e.message);
  }
}

// What the service knows about each label (GET /gallery/diagnostics: overlaps, one-image
// labels, outliers), filled in row by row after the table shows: one call at a time (the
// service bounds how many run at once), the first LABEL_CHECKS labels only.
const LABEL_CHECKS = 200;
let labelsShown = 0; // a newer listing stops an older one's checks
async function labelChecks(rows, shown) {
  for (const tr of rows.slice(0, LABEL_CHECKS)) {
    if (shown !== labelsShown) return;
    const td = tr.querySelector("td.checks");
    try {
      const d = await api(`/gallery/diagnostics?${new URLSearchParams({ label: tr.dataset.label })}`);
      if (d.warnings.length) {
        const ul = document.createElement("ul");
        ul.className = "warnings";
        ul.replaceChildren(...d.warnings.map((w) => {
          const li = document.createElement("li");
          li.className = "warning";
          // long lists (every suspected image) cut short here, whole in the tooltip
          li.textContent = w.length > 160 ? `${w.slice(0, 157)}…` : w;
          li.title = w;
          return li;
        }));
        td.replaceChildren(ul);
        td.classList.remove("muted");
      } else {
        td.textContent = "ok";
      }
    } catch (e) {
      td.textContent = `not checked: ${e.message}`;
    }
  }
  for (const tr of rows.slice(LABEL_CHECKS)) tr.querySelector("td.checks").textContent = "";
}

// a label's items as thumbnails, a page at a time, each relabelled (its label) or removed
let itemsFor = null;
let itemsToken = null;
async function loadItems(label, more = false) {
  try {
    const q = new URLSearchParams({ label, limit: "48", ...(more && itemsToken ? { page_token: itemsToken } : {}) });
    const r = await api(`/gallery/items?${q}`);
    itemsFor = label;
    itemsToken = r.next_page_token;
    $("items-label").textContent = label;
    const cells = r.items.map((it) => {
      const div = cell({ id: it.id, label: it.label, note: it.source, thumbnail_url: it.thumbnail_url });
      div.title = `#${it.id} · ${it.source} · added ${it.created_at}` + (it.metadata ? ` · ${JSON.stringify(it.metadata).slice(0, 200)}` : "");
      const del = document.createElement("button");
      del.type = "button";
      del.className = "item-remove";
      del.textContent = "remove";
      del.addEventListener("click", () => removeItem(it.id, div));
      div.append(del);
      return div;
    });
    if (more) $("items-list").append(...cells);
    else $("items-list").replaceChildren(...cells);
    $("items-more").hidden = !itemsToken;
    $("items-panel").hidden = false;
    if (!more) $("items-panel").scrollIntoView();
    applyAccess();
  } catch (e) {
    say(e.message);
  }
}

async function removeItem(id, div) {
  if (!confirm(`Remove item #${id} from the gallery?`)) return;
  try {
    await api(`/gallery/items/${id}`, { method: "DELETE" });
    div.remove();
    say(`item #${id} removed`, true);
    refreshStatus();
  } catch (e) {
    say(e.message);
  }
}

async function deleteLabel(label, count) {
  if (!confirm(`Delete all ${count} items of "${label}"?`)) return;
  try {
    const r = await api(`/gallery/labels/${encodeURIComponent(label)}`, { method: "DELETE" });
    say(`deleted ${r.deleted.length} item(s) of "${label}"`, true);
    loadLabels();
    refreshStatus();
  } catch (e) {
    say(e.message);
  }
}

// ---------------------------------------------------------------- corrections
async function relabelItem(id, button) {
  const label = prompt(`New label for item #${id}:`, button.textContent);
  if (label === null || !label.trim() || label.trim() === button.textContent) return;
  try {
    const r = await api(`/gallery/items/${id}`, {
      method: "PATCH", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ label: label.trim() }),
    });
    button.textContent = r.label;
    say(`item #${id} is now "${r.label}"`, true);
    refreshStatus();
  } catch (e) {
    say(e.message);
  }
}

async function renameLabel(label, labels) {
  const to = prompt(`Rename "${label}" to:`, label);
  if (to === null || !to.trim() || to.trim() === label) return;
  const merge = labels.includes(to.trim());
  if (merge && !confirm(`"${to.trim()}" exists: merge every item of "${label}" into it?`)) return;
  const kind = merge ? "merge" : "rename";
  try {
    const r = await api(`/gallery/${kind}`, {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(merge ? { label, into: to.trim() } : { label, to: to.trim() }),
    });
    say(`${r.count} item(s) of "${label}" are now "${r.label}"`, true);
    loadLabels();
    refreshStatus();
  } catch (e) {
    say(e.message);
  }
}

let suggestFor = null;

async function loadSuggestions(label) {
  try {
    const r = await api(`/gallery/suggestions?${new URLSearchParams({ label, limit: "60" })}`);
    suggestFor = label;
    $("suggest-label").textContent = label;
    $("suggest-list").replaceChildren(...r.suggestions.map((s) => {
      const div = cell({ id: s.id, label: s.kind === "queued" ? `queued: ${s.label ?? "unknown"}` : s.label,
        similarity: s.score, thumbnail_url: s.thumbnail_url });
      div.dataset.kind = s.kind;
      div.querySelector(".cell-label").disabled = true; // (accept below, not edit here)
      div.title = `score ${s.score.toFixed(3)}; nearest item of "${label}": #${s.near_id} (cosine ${s.near_similarity.toFixed(3)})`;
      const box = document.createElement("input");
      box.type = "checkbox";
      box.checked = s.score > 0; // (the vote gives it to the label)
      box.setAttribute("aria-label", `accept #${s.id}`);
      div.append(box);
      return div;
    }));
    $("suggest-panel").hidden = false;
    if (!r.suggestions.length) say(`no suggestions for "${label}"`, true);
    applyAccess();
  } catch (e) {
    say(e.message);
  }
}

async function acceptSuggestions() {
  const ticked = [...document.querySelectorAll("#suggest-list .cell")].filter((c) => c.querySelector("input").checked);
  const items = ticked.filter((c) => c.dataset.kind === "item").map((c) => Number(c.dataset.id));
  const queued = ticked.filter((c) => c.dataset.kind === "queued").map((c) => Number(c.dataset.id));
  if (!items.length && !queued.length) return say("tick the suggestions that belong to the label");
  const json = (body) => ({ method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
  try {
    let moved = 0;
    if (items.length) moved += (await api("/gallery/relabel", json({ ids: items, label: suggestFor }))).relabelled.length;
    if (queued.length) moved += (await api("/review/name", json({ ids: queued, label: suggestFor }))).ids.length;
    say(`${moved} item(s) are now "${suggestFor}"`, true);
    loadSuggestions(suggestFor);
    refreshStatus();
  } catch (e) {
    say(e.message);
  }
}

// ---------------------------------------------------------------- review
async function loadReview() {
  try {
    const r = await api("/review?limit=500");
    $("review-summary").textContent = !r.enabled && r.queued === 0
      ? "The review queue is off: start the service with SNCA_REVIEW_QUEUE=1 to keep what it cannot name."
      : `${r.queued} queries the service could not name, in ${r.groups.length} group(s) of similar ones (the newest ${r.grouped}). Name a group to make its queries items of that label, or dismiss it.`;
    const groups = r.groups.map((g, n) => {
      const div = document.createElement("div");
      div.className = "group";
      const h = document.createElement("h3");
      h.textContent = `${g.size} quer${g.size === 1 ? "y" : "ies"}` + (g.nearest_label ? ` · nearest label ${g.nearest_label}` : "");
      const grid = document.createElement("div");
      grid.className = "grid";
      grid.append(...g.sample.map((q) => {
        const c = cell({ id: q.id, label: q.answer ?? "unknown", similarity: q.margin, thumbnail_url: q.thumbnail_url });
        // a queued query is not an item: its answer is shown, not edited (naming the group
        // below makes it one); `read` keeps applyAccess from turning the button on
        const lab = c.querySelector(".cell-label");
        lab.disabled = true;
        lab.classList.add("read");
        lab.title = "the service's answer to this query";
        // a member that does not belong is unticked and left out when the group is named
        const tick = document.createElement("input");
        tick.type = "checkbox";
        tick.checked = true;
        tick.className = "member";
        tick.dataset.id = q.id;
        tick.title = "in this group: untick to leave it out when naming";
        tick.setAttribute("aria-label", `query #${q.id} in this group`);
        c.prepend(tick);
        return c;
      }));
      const actions = document.createElement("div");
      actions.className = "actions";
      const input = document.createElement("input");
      input.placeholder = "name this group";
      input.id = `review-label-${n}`;
      const name = document.createElement("button");
      name.type = "button";
      name.textContent = "Name";
      name.className = "review-name";
      name.addEventListener("click", () => {
        const out = new Set([...grid.querySelectorAll("input.member:not(:checked)")].map((t) => Number(t.dataset.id)));
        nameGroup(g.ids.filter((id) => !out.has(id)), input.value);
      });
      const dismiss = document.createElement("button");
      dismiss.type = "button";
      dismiss.textContent = "Dismiss";
      dismiss.className = "review-dismiss";
      dismiss.addEventListener("click", () => dismissGroup(g.ids));
      actions.append(input, name, dismiss);
      div.append(h, grid, actions);
      div.dataset.size = g.size;
      return div;
    });
    // single queries (nothing like them queued) folded under one line, after the groups
    const many = groups.filter((d) => Number(d.dataset.size) > 1);
    const single = groups.filter((d) => Number(d.dataset.size) === 1);
    if (single.length) {
      const fold = document.createElement("details");
      fold.id = "review-singles";
      const sum = document.createElement("summary");
      sum.textContent = `${single.length} single quer${single.length === 1 ? "y" : "ies"} (nothing like them queued)`;
      fold.append(sum, ...single);
      many.push(fold);
    }
    $("review-groups").replaceChildren(...many);
    applyAccess();
  } catch (e) {
    say(e.message);
  }
}

async function nameGroup(ids, label) {
  if (!label.trim()) return say("type a label for the group first");
  try {
    const r = await api("/review/name", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ ids, label: label.trim() }) });
    say(`${r.ids.length} queries are now items of "${r.label}" (${r.count} in all)`, true);
    loadReview();
    refreshStatus();
  } catch (e) {
    say(e.message);
  }
}

async function dismissGroup(ids) {
  try {
    const r = await api("/review/dismiss", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ ids }) });
    say(`dismissed ${r.dismissed} queries`, true);
    loadReview();
  } catch (e) {
    say(e.message);
  }
}

// ---------------------------------------------------------------- search
async function search(file) {
  say("");
  const fd = new FormData();
  fd.append("image", file);
  try {
    const r = await api(`/search?k=${encodeURIComponent($("search-k").value || "12")}`, { method: "POST", body: fd });
    $("search-results").replaceChildren(...r.items.map(cell));
  } catch (e) {
    $("search-results").replaceChildren();
    say(e.message);
  }
}

// ---------------------------------------------------------------- wiring
// What this tab's key may do (/readyz "access": write, read or none): a read key gets the
// write controls disabled, with the reason, instead of a 403 after the fact.
let access = "write";

function applyAccess() {
  const readOnly = access !== "write";
  const why = access === "read" ? "this API key may only read" : "an API key of scope write is needed";
  $("register-submit").disabled = readOnly;
  $("register-submit").title = readOnly ? why : "";
  $("register-readonly").hidden = !readOnly;
  $("register-readonly").textContent = readOnly ? `Registering is off: ${why}.` : "";
  const writes = [
    ...document.querySelectorAll("#labels-table button:not(.read)"),
    ...document.querySelectorAll("#review-groups button:not(.read), #review-groups input"),
    ...document.querySelectorAll("#items-list button"),
    $("suggest-accept"),
  ];
  for (const b of writes) {
    b.disabled = readOnly;
    b.title = readOnly ? why : "";
  }
  for (const b of document.querySelectorAll("#classify-neighbours .cell-label, #search-results .cell-label")) {
    b.disabled = readOnly;
  }
  $("review-readonly").hidden = !readOnly;
  $("review-readonly").textContent = readOnly ? `Naming and dismissing are off: ${why}.` : "";
  const learning = $("learn-start").dataset.running === "1";
  $("learn-start").disabled = readOnly || learning;
  $("learn-start").title = readOnly ? why : (learning ? "a learn is running" : "");
}

async function refreshStatus() {
  try {
    const ready = await fetch("/readyz", { headers: headers() }).then((r) => r.json());
    if (ready.access) access = ready.access;
  } catch (_) { /* the labels call below says why */ }
  applyAccess();
  try {
    const r = await api("/gallery/labels?limit=1");
    $("empty-gallery").hidden = r.total !== 0; // a model served with nothing trained starts here
    $("status").textContent = `${r.total} items · ${r.label_count} labels · version ${r.gallery_version}` + (access === "read" ? " · read-only key" : "");
  } catch (e) {
    $("status").textContent = e.message.startsWith("401") ? "API key needed" : "service unreachable";
  }
}

// `onFiles` takes every file dropped or picked; `onFile` alone, the first.
function dropZone(zone, input, onFile, onFiles = (fs) => onFile(fs[0])) {
  zone.addEventListener("dragover", (e) => { e.preventDefault(); zone.classList.add("over"); });
  zone.addEventListener("dragleave", () => zone.classList.remove("over"));
  zone.addEventListener("drop", (e) => {
    e.preventDefault();
    zone.classList.remove("over");
    if (e.dataTransfer.files.length) onFiles([...e.dataTransfer.files]);
  });
  input.addEventListener("change", () => { if (input.files.length) onFiles([...input.files]); });
}

document.addEventListener("DOMContentLoaded", () => {
  // The key lives for this tab's session only (never in localStorage, which any script of
  // this origin could read later, and which earlier versions used: removed).
  localStorage.removeItem("snca-api-key");
  $("apikey").value = sessionStorage.getItem("snca-api-key") || "";
  $("apikey").addEventListener("change", () => {
    sessionStorage.setItem("snca-api-key", apiKey());
    refreshStatus();
  });
  for (const b of document.querySelectorAll("nav button")) b.addEventListener("click", () => showTab(b.dataset.tab));
  dropZone($("classify-drop"), $("classify-file"), classify, classifyMany);
  document.addEventListener("paste", onPaste);
  dropZone($("search-file").parentElement, $("search-file"), search);
  $("register-form").addEventListener("submit", register);
  $("suggest-accept").addEventListener("click", acceptSuggestions);
  $("items-more").addEventListener("click", () => loadItems(itemsFor, true));
  $("learn-start").addEventListener("click", startLearn);
  $("classify-register").addEventListener("click", carryToRegister);
  $("empty-register").addEventListener("click", () => showTab("register"));
  $("register-files").addEventListener("change", () => { $("register-carried").hidden = true; });
  for (const f of ["classify-form", "search-form"]) $(f).addEventListener("submit", (e) => e.preventDefault());
  refreshStatus();
});
