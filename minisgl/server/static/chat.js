// The chat page: multi-turn history kept here, each turn sent to /v1/chat/completions with
// stream=true and read as server-sent events; Stop aborts the fetch (the server sees the
// connection close and aborts the request). Settings persist in localStorage; the API key only
// in sessionStorage (gone with the tab).
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const els = {
    model: $("model"), newChat: $("new-chat"), system: $("system"), temperature: $("temperature"),
    topP: $("top-p"), maxTokens: $("max-tokens"), apiKey: $("api-key"), stats: $("stats"),
    messages: $("messages"), composer: $("composer"), prompt: $("prompt"), send: $("send"), stop: $("stop"),
  };
  const SETTINGS_KEY = "minisgl.chat.settings";
  const API_KEY_KEY = "minisgl.chat.apiKey";
  const history = [];  // {role, content} of the turns sent so far (a stopped answer counts, as far as it got)
  let controller = null;
  let conversation = 0;  // New chat starts the next one; a turn still ending then leaves history alone
  let modelId = "default";

  // ---------------------------------------------------------------- settings
  function loadSettings() {
    try {
      const saved = JSON.parse(localStorage.getItem(SETTINGS_KEY) || "{}");
      for (const name of ["system", "temperature", "topP", "maxTokens"]) {
        if (typeof saved[name] === "string") els[name].value = saved[name];
      }
      els.apiKey.value = sessionStorage.getItem(API_KEY_KEY) || "";
    } catch (_) { /* storage unavailable or corrupt: keep the defaults */ }
    showSliders();
  }

  function saveSettings() {
    const values = {};
    for (const name of ["system", "temperature", "topP", "maxTokens"]) values[name] = els[name].value;
    try {
      localStorage.setItem(SETTINGS_KEY, JSON.stringify(values));
      sessionStorage.setItem(API_KEY_KEY, els.apiKey.value);
    } catch (_) { /* private mode: settings last as long as the page */ }
  }

  function showSliders() {
    $("temperature-value").textContent = Number(els.temperature.value).toFixed(2);
    $("top-p-value").textContent = Number(els.topP.value).toFixed(2);
  }

  function headers() {
    const out = { "Content-Type": "application/json" };
    const key = els.apiKey.value.trim();
    if (key) out.Authorization = `Bearer ${key}`;
    return out;
  }

  async function errorText(response) {
    const raw = await response.text();
    try {
      const body = JSON.parse(raw);
      if (body && body.error) return `HTTP ${response.status}: ${body.error.message || JSON.stringify(body.error)}`;
    } catch (_) { /* not JSON */ }
    return `HTTP ${response.status}: ${raw.slice(0, 300)}`;
  }

  async function loadModel() {
    try {
      const response = await fetch("/v1/models", { headers: headers() });
      if (response.ok) {
        modelId = (await response.json()).data[0].id;
        els.model.textContent = modelId;
      } else {
        els.model.textContent = response.status === 401 ? "API key needed (see settings)" : await errorText(response);
      }
    } catch (err) {
      els.model.textContent = `server unreachable: ${err.message}`;
    }
  }

  // ---------------------------------------------------------------- messages
  function addMessage(role, text) {
    const div = document.createElement("div");
    div.className = `message ${role}`;
    if (role === "user") {
      div.textContent = text;
    } else {
      div.appendChild(document.createElement("div")).className = "content";
      div.appendChild(document.createElement("span")).className = "note";
    }
    els.messages.appendChild(div);
    scrollDown();
    return div;
  }

  function scrollDown() {
    els.messages.scrollTop = els.messages.scrollHeight;
  }

  function setBusy(busy) {
    els.send.disabled = busy;
    els.stop.disabled = !busy;
  }

  function requestBody() {
    const messages = [];
    const system = els.system.value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push(...history);
    const body = { model: modelId, messages, stream: true, stream_options: { include_usage: true },
                   temperature: Number(els.temperature.value), top_p: Number(els.topP.value) };
    const maxTokens = parseInt(els.maxTokens.value, 10);
    if (Number.isFinite(maxTokens) && maxTokens > 0) body.max_tokens = maxTokens;
    return body;
  }

  // The data of each server-sent event (multi-line data joined with "\n"), as it arrives.
  async function* sseData(response) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      buffer += decoder.decode(value || new Uint8Array(), { stream: !done }).replace(/\r\n?/g, "\n");
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).replace(/^ /, ""));
        if (data.length) yield data.join("\n");
      }
      if (done) return;
    }
  }

  async function send(text) {
    const mine = conversation;
    const remember = (turn) => { if (mine === conversation) history.push(turn); };
    history.push({ role: "user", content: text });
    addMessage("user", text);
    const bubble = addMessage("assistant");
    const content = bubble.querySelector(".content");
    const note = bubble.querySelector(".note");
    bubble.dataset.state = "streaming";
    let answer = "";
    let usage = null;
    let finish = null;
    let firstAt = null;
    const startedAt = performance.now();
    controller = new AbortController();
    setBusy(true);
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST", headers: headers(), body: JSON.stringify(requestBody()), signal: controller.signal,
      });
      if (!response.ok) throw new Error(await errorText(response));
      for await (const data of sseData(response)) {
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
        const choice = chunk.choices && chunk.choices[0];
        const piece = choice && choice.delta && choice.delta.content;
        if (piece) {
          if (firstAt === null) firstAt = performance.now();
          answer += piece;
          content.innerHTML = window.renderMarkdown(answer);
          scrollDown();
        }
        if (choice && choice.finish_reason) finish = choice.finish_reason;
        if (chunk.usage) usage = chunk.usage;
      }
      remember({ role: "assistant", content: answer });
      bubble.dataset.state = "done";
      note.textContent = summary(usage, finish, startedAt, firstAt);
    } catch (err) {
      if (err.name === "AbortError") {
        remember({ role: "assistant", content: answer });
        bubble.dataset.state = "stopped";
        note.textContent = "stopped";
      } else {
        if (mine === conversation) history.pop();  // the failed question is not part of the conversation
        bubble.dataset.state = "error";
        bubble.classList.add("error");
        note.textContent = err.message;
        if (!els.prompt.value) els.prompt.value = text;
      }
    } finally {
      controller = null;
      setBusy(false);
      els.stats.textContent = note.textContent;
      scrollDown();
    }
  }

  function summary(usage, finish, startedAt, firstAt) {
    const parts = [];
    const now = performance.now();
    if (usage) parts.push(`${usage.prompt_tokens} prompt + ${usage.completion_tokens} generated tokens`);
    if (firstAt !== null) parts.push(`first token ${Math.round(firstAt - startedAt)} ms`);
    if (usage && firstAt !== null && usage.completion_tokens > 1 && now > firstAt) {
      parts.push(`${((usage.completion_tokens - 1) / ((now - firstAt) / 1000)).toFixed(1)} tok/s`);
    }
    if (finish) parts.push(`finish: ${finish}`);
    return parts.join(" · ");
  }

  // ---------------------------------------------------------------- wiring
  els.composer.addEventListener("submit", (event) => {
    event.preventDefault();
    const text = els.prompt.value.trim();
    if (!text || controller) return;
    els.prompt.value = "";
    send(text);
  });
  els.prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      els.composer.requestSubmit();
    }
  });
  els.stop.addEventListener("click", () => { if (controller) controller.abort(); });
  els.newChat.addEventListener("click", () => {
    if (controller) controller.abort();
    conversation += 1;
    history.length = 0;
    els.messages.replaceChildren();
    els.stats.textContent = "";
  });
  for (const name of ["system", "temperature", "topP", "maxTokens"]) {
    els[name].addEventListener("input", () => { showSliders(); saveSettings(); });
  }
  els.apiKey.addEventListener("change", () => { saveSettings(); loadModel(); });

  loadSettings();
  loadModel();
})();
