// A small markdown renderer for model answers (fenced code, headings, lists, quotes, rules,
// bold, italic, inline code, links). Safe by construction: the whole text is HTML-escaped
// before any markup is recognised, so every tag in the output is one written here, and a link
// is made only for http(s) and mailto URLs (never javascript: or data:).
"use strict";
(function (root) {
  const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

  function escapeHtml(text) {
    return String(text).replace(/[&<>"']/g, (c) => ESCAPES[c]);
  }

  function safeUrl(url) {  // url is escaped already; the scheme test sees what the browser would
    return /^(https?:\/\/|mailto:)/i.test(url);
  }

  // Bold and italic on escaped text without code spans or links in it.
  function emphasis(text) {
    return text
      .replace(/\*\*(?=\S)([^\n]*?\S)\*\*|__(?=\S)([^\n]*?\S)__/g, (_, a, b) => `<strong>${a ?? b}</strong>`)
      .replace(/\*(?=[^\s*])([^*\n]*?[^\s*])\*/g, "<em>$1</em>")
      .replace(/(^|[^\w])_(?=[^\s_])([^_\n]*?[^\s_])_(?![\w])/g, "$1<em>$2</em>");
  }

  // One line (or paragraph) of escaped text. Code spans and links are held out as numbered
  // placeholders so emphasis never reaches into them.
  function inline(text) {
    const held = [];
    const hold = (html) => `\u0000${held.push(html) - 1}\u0000`;
    text = text.replace(/`([^`\n]+)`/g, (_, code) => hold(`<code>${code}</code>`));
    text = text.replace(/\[([^\]\n]+)\]\(([^()\s]+)\)/g, (whole, label, url) =>
      safeUrl(url) ? hold(`<a href="${url}" target="_blank" rel="noopener noreferrer">${emphasis(label)}</a>`) : whole);
    text = emphasis(text);
    return text.replace(/\u0000(\d+)\u0000/g, (_, i) => held[Number(i)]);
  }

  const FENCE = /^\s*(```|~~~)(.*)$/;  // plus a language word or nothing: see fence()
  const HEADING = /^(#{1,6})\s+(.*)$/;
  const RULE = /^\s*([-*_])(\s*\1){2,}\s*$/;
  const BULLET = /^\s*[-*+]\s+(.*)$/;
  const NUMBERED = /^\s*(\d{1,9})[.)]\s+(.*)$/;
  const QUOTE = /^\s*&gt;\s?(.*)$/;

  function render(source) {
    const lines = escapeHtml(String(source).replace(/\u0000/g, "").replace(/\r\n?/g, "\n")).split("\n");
    const out = [];
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if ((m = fence(line))) {  // an unclosed fence (still streaming) runs to the end
        const body = [];
        for (i++; i < lines.length && !(fence(lines[i]) && fence(lines[i])[1] === m[1]); i++) body.push(lines[i]);
        i++;
        const lang = m[2] ? ` class="language-${m[2]}"` : "";
        out.push(`<pre><code${lang}>${body.join("\n")}</code></pre>`);
      } else if (!line.trim()) {
        i++;
      } else if ((m = HEADING.exec(line))) {
        out.push(`<h${m[1].length}>${inline(headingText(m[2]))}</h${m[1].length}>`);
        i++;
      } else if (RULE.test(line)) {
        out.push("<hr>");
        i++;
      } else if (BULLET.test(line) || NUMBERED.test(line)) {
        const ordered = !BULLET.test(line);
        const pattern = ordered ? NUMBERED : BULLET;
        const items = [];
        const start = ordered ? Number(NUMBERED.exec(line)[1]) : 1;
        for (; i < lines.length && (m = pattern.exec(lines[i])); i++) items.push(`<li>${inline(m[ordered ? 2 : 1])}</li>`);
        const tag = ordered ? "ol" : "ul";
        const attr = ordered && start !== 1 ? ` start="${start}"` : "";
        out.push(`<${tag}${attr}>${items.join("")}</${tag}>`);
      } else if (QUOTE.test(line)) {
        const quoted = [];
        for (; i < lines.length && (m = QUOTE.exec(lines[i])); i++) quoted.push(inline(m[1]));
        out.push(`<blockquote>${quoted.join("<br>")}</blockquote>`);
      } else {
        const para = [];
        for (; i < lines.length && lines[i].trim() && !startsBlock(lines[i]); i++) para.push(inline(lines[i]));
        out.push(`<p>${para.join("<br>")}</p>`);
      }
    }
    return out.join("\n");
  }

  // [line, marker, language] of a code fence line, or null. Kept apart from the regex so that no
  // pattern has two runs of spaces to trade between (a long line must stay linear).
  function fence(line) {
    const m = FENCE.exec(line);
    if (!m) return null;
    const info = m[2].trim();
    return /^[\w+.#-]*$/.test(info) ? [line, m[1], info] : null;
  }

  // "## Title ##" -> "Title", without a backtracking regex (a long line of spaces must stay cheap).
  function headingText(text) {
    text = text.trimEnd();
    let end = text.length;
    while (end > 0 && text[end - 1] === "#") end--;
    return end === 0 || /\s/.test(text[end - 1]) ? text.slice(0, end).trimEnd() : text;
  }

  function startsBlock(line) {
    return fence(line) !== null || [HEADING, RULE, BULLET, NUMBERED, QUOTE].some((re) => re.test(line));
  }

  root.renderMarkdown = render;
  root.escapeHtml = escapeHtml;
})(typeof window !== "undefined" ? window : globalThis);
