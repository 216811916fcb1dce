// Renders the maths of the pages (pymdownx.arithmatex, generic mode: \( ... \) inline and
// \[ ... \] on its own line, inside elements of class "arithmatex") with KaTeX 0.19.1, which the
// site serves from assets/katex/ (MIT licence beside it): the site loads nothing from elsewhere.
(function () {
  function render(root) {
    root.querySelectorAll(".arithmatex").forEach(function (element) {
      renderMathInElement(element, {
        delimiters: [
          { left: "\\(", right: "\\)", display: false },
          { left: "\\[", right: "\\]", display: true },
        ],
      });
    });
  }
  if (typeof document$ !== "undefined") {
    document$.subscribe(function () { render(document.body); });  // Material: each page, instant navigation or not
  } else if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", function () { render(document.body); });
  } else {
    render(document.body);
  }
})();
