// Typesets the formulas of a page with the KaTeX copy served from this site (docs/assets/katex, no network).
// pymdownx.arithmatex (generic mode) leaves \( ... \) and \[ ... \] in elements of class "arithmatex".
document.addEventListener("DOMContentLoaded", function () {
  for (const element of document.querySelectorAll(".arithmatex")) {
    renderMathInElement(element, {
      delimiters: [
        { left: "\\(", right: "\\)", display: false },
        { left: "\\[", right: "\\]", display: true },
      ],
      throwOnError: false,
    });
  }
});
